"""TNT (target-driven trajectory prediction) on top of a VectorNet encoder.

Training uses teacher forcing with the ground-truth endpoint; inference picks the top-K targets.

    torchrun --nproc_per_node=8 11_tnt_target_driven.py --data /datasets/av1_tnt --save-dir runs/tnt
"""
import argparse
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

FUT = 30


def get_parser():
    p = argparse.ArgumentParser("TNT")
    p.add_argument("--data", default="/datasets/av1_tnt")
    p.add_argument("--save-dir", default="runs/tnt")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--k", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--num-workers", type=int, default=8)
    p.add_argument("--resume", default="")
    return p


class TNTData(Dataset):
    def __init__(self, root, split):
        with open(os.path.join(root, f"{split}.pkl"), "rb") as f:
            self.data = pickle.load(f)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        d = self.data[i]
        return {"polys": [torch.from_numpy(p).float() for p in d["polylines"]],  # focal agent first
                "cands": torch.from_numpy(d["candidates"]).float(),            # (Nc, 2) lane points ~1 m apart
                "fut": torch.from_numpy(d["future"]).float()}


def collate(items):
    B = len(items)
    P = max(len(it["polys"]) for it in items)
    V = max(p.shape[0] for it in items for p in it["polys"])
    Nc = max(it["cands"].shape[0] for it in items)
    polys = torch.zeros(B, P, V, items[0]["polys"][0].shape[-1])
    vmask = torch.zeros(B, P, V, dtype=torch.bool)
    cands = torch.zeros(B, Nc, 2)
    cmask = torch.zeros(B, Nc, dtype=torch.bool)
    for b, it in enumerate(items):
        for j, p in enumerate(it["polys"]):
            polys[b, j, : len(p)] = p
            vmask[b, j, : len(p)] = True
        cands[b, : len(it["cands"])] = it["cands"]
        cmask[b, : len(it["cands"])] = True
    return {"polys": polys, "vmask": vmask, "cands": cands, "cmask": cmask,
            "fut": torch.stack([it["fut"] for it in items])}


def mlp(i, h, o):
    return nn.Sequential(nn.Linear(i, h), nn.LayerNorm(h), nn.ReLU(inplace=True), nn.Linear(h, o))


class TNT(nn.Module):
    def __init__(self, in_dim=10, hidden=64, k=6):
        super().__init__()
        self.k = k
        self.sub = nn.ModuleList([mlp(in_dim if i == 0 else 2 * hidden, hidden, hidden) for i in range(3)])
        self.glob = nn.MultiheadAttention(2 * hidden, 1, batch_first=True)
        g = 2 * hidden
        self.target_prob = mlp(g + 2, hidden, 1)
        self.target_offset = mlp(g + 2, hidden, 2)
        self.motion = mlp(g + 2, hidden, FUT * 2)

    def encode(self, polys, vmask):
        x, m = polys, vmask.unsqueeze(-1)
        for layer in self.sub:
            h = layer(x)
            pooled = h.masked_fill(~m, -1e9).max(2, keepdim=True).values
            x = torch.cat([h, pooled.expand_as(h)], -1)
        node = x.masked_fill(~m, -1e9).max(2).values
        pmask = vmask.any(-1)
        node = node.masked_fill(~pmask.unsqueeze(-1), 0.0)
        out, _ = self.glob(node, node, node, key_padding_mask=~pmask)
        return out[:, 0]

    def target_logits(self, feat, cands, cmask):
        f = torch.cat([feat[:, None].expand(-1, cands.shape[1], -1), cands], -1)
        logits = self.target_prob(f).squeeze(-1).masked_fill(~cmask, -1e4)
        return logits, self.target_offset(f)

    def forward(self, polys, vmask, cands, cmask, gt_end):
        feat = self.encode(polys, vmask)
        logits, offsets = self.target_logits(feat, cands, cmask)
        traj = self.motion(torch.cat([feat, gt_end], -1)).view(-1, FUT, 2)
        return logits, offsets, traj

    @torch.no_grad()
    def inference(self, polys, vmask, cands, cmask):
        feat = self.encode(polys, vmask)
        logits, offsets = self.target_logits(feat, cands, cmask)
        top = logits.topk(self.k, dim=1).indices
        targets = cands.gather(1, top[..., None].expand(-1, -1, 2)) + offsets.gather(1, top[..., None].expand(-1, -1, 2))
        f = torch.cat([feat[:, None].expand(-1, self.k, -1), targets], -1)
        return self.motion(f).view(-1, self.k, FUT, 2)


def tnt_loss(logits, offsets, traj, cands, cmask, fut):
    end = fut[:, -1]
    d = torch.norm(cands - end[:, None], dim=-1).masked_fill(~cmask, 1e6)
    gt_idx = d.argmin(1)
    cls = F.cross_entropy(logits, gt_idx)
    ar = torch.arange(len(gt_idx), device=fut.device)
    off = F.smooth_l1_loss(offsets[ar, gt_idx], end - cands[ar, gt_idx])
    reg = F.smooth_l1_loss(traj, fut)
    return cls + off + reg, {"cls": cls.detach(), "off": off.detach(), "reg": reg.detach()}


def evaluate(model, loader, device, k):
    model.eval()
    acc = torch.zeros(4, device=device)
    for b in loader:
        b = {n: t.to(device, non_blocking=True) for n, t in b.items()}
        pred = model.inference(b["polys"], b["vmask"], b["cands"], b["cmask"])
        err = torch.norm(pred - b["fut"][:, None], dim=-1)
        acc[0] += err.mean(-1).min(-1).values.sum()
        acc[1] += err[..., -1].min(-1).values.sum()
        acc[2] += (err[..., -1].min(-1).values > 2.0).sum()
        acc[3] += len(pred)
    dist.all_reduce(acc)
    model.train()
    return {f"minADE{k}": (acc[0] / acc[3]).item(), f"minFDE{k}": (acc[1] / acc[3]).item(),
            f"MR{k}": (acc[2] / acc[3]).item()}


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_set, val_set = TNTData(args.data, "train"), TNTData(args.data, "val")
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, collate_fn=collate,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world)),
                            batch_size=args.batch_size, collate_fn=collate, num_workers=args.num_workers)

    model = TNT(hidden=args.hidden, k=args.k).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    lr = args.lr * world * args.batch_size / 256
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)

    start_epoch, best = 0, float("inf")
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, b in enumerate(train_loader):
            b = {n: t.to(device, non_blocking=True) for n, t in b.items()}
            logits, offsets, traj = model(b["polys"], b["vmask"], b["cands"], b["cmask"], b["fut"][:, -1])
            loss, parts = tnt_loss(logits, offsets, traj, b["cands"], b["cmask"], b["fut"])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if it % 100 == 0:
                stats = torch.stack([loss.detach(), parts["cls"], parts["off"], parts["reg"]])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"[{epoch}:{it}/{len(train_loader)}] loss {stats[0]:.3f} cls {stats[1]:.3f} "
                          f"off {stats[2]:.3f} reg {stats[3]:.3f} ({time.time() - t0:.0f}s)", flush=True)
        scheduler.step()

        metrics = evaluate(model, val_loader, device, args.k)
        fde = metrics[f"minFDE{args.k}"]
        if rank == 0:
            print(f"epoch {epoch}: " + ", ".join(f"{n} {v:.3f}" for n, v in metrics.items()), flush=True)
            ck = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                  "scheduler": scheduler.state_dict(), "epoch": epoch, "best": min(best, fde)}
            torch.save(ck, os.path.join(args.save_dir, "latest.pth"))
            if fde < best:
                torch.save(ck, os.path.join(args.save_dir, "best.pth"))
        best = min(best, fde)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
