"""VectorNet trajectory forecasting (Argoverse-style scenarios), DDP + grad accumulation.

Each preprocessed scenario file holds the focal agent, surrounding agents and
lane centerlines as vector polylines in the focal agent's frame at t=19.
"""
import argparse
import contextlib
import glob
import json
import math
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

HIST, FUT, K = 20, 30, 6


def get_args():
    ap = argparse.ArgumentParser("vectornet")
    ap.add_argument("--train-dir", default="/data/argo/processed/train")
    ap.add_argument("--val-dir", default="/data/argo/processed/val")
    ap.add_argument("--output", default="runs/vectornet")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=64, help="per GPU")
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--base-lr", type=float, default=1e-3, help="lr at global batch 256")
    ap.add_argument("--num-workers", type=int, default=8)
    ap.add_argument("--max-polylines", type=int, default=160)
    ap.add_argument("--resume", type=str, default=None)
    ap.add_argument("--seed", type=int, default=42)
    return ap.parse_args()


class ScenarioDataset(Dataset):
    def __init__(self, root, max_polylines):
        self.files = sorted(glob.glob(os.path.join(root, "*.pkl")))
        self.max_polylines = max_polylines

    def __len__(self):
        return len(self.files)

    def __getitem__(self, idx):
        with open(self.files[idx], "rb") as f:
            s = pickle.load(f)
        # s["polylines"]: list of (n_vec, 8) arrays, focal agent first, then agents, then lanes
        polylines = [torch.from_numpy(p).float() for p in s["polylines"][: self.max_polylines]]
        fut = torch.from_numpy(s["focal_future"]).float()  # (30, 2)
        return {"polylines": polylines, "future": fut, "seq_id": int(s["seq_id"])}


def collate_scenarios(batch):
    B = len(batch)
    P = max(len(b["polylines"]) for b in batch)
    V = max(p.shape[0] for b in batch for p in b["polylines"])
    Fdim = batch[0]["polylines"][0].shape[1]
    x = torch.zeros(B, P, V, Fdim)
    vec_mask = torch.zeros(B, P, V, dtype=torch.bool)
    poly_mask = torch.zeros(B, P, dtype=torch.bool)
    for i, b in enumerate(batch):
        for j, p in enumerate(b["polylines"]):
            x[i, j, : p.shape[0]] = p
            vec_mask[i, j, : p.shape[0]] = True
            poly_mask[i, j] = True
    return {
        "x": x, "vec_mask": vec_mask, "poly_mask": poly_mask,
        "future": torch.stack([b["future"] for b in batch]),
        "seq_id": torch.tensor([b["seq_id"] for b in batch]),
    }


class SubGraph(nn.Module):
    def __init__(self, in_ch, hidden, num_layers=3):
        super().__init__()
        self.layers = nn.ModuleList()
        for i in range(num_layers):
            cin = in_ch if i == 0 else hidden * 2
            self.layers.append(nn.Sequential(nn.Linear(cin, hidden), nn.LayerNorm(hidden), nn.ReLU(inplace=True)))

    def forward(self, x, vec_mask):
        m = vec_mask.unsqueeze(-1)
        for layer in self.layers:
            h = layer(x)
            agg = h.masked_fill(~m, -1e4).max(dim=2, keepdim=True).values
            x = torch.cat([h, agg.expand_as(h)], dim=-1)
        poly = x.masked_fill(~m, -1e4).max(dim=2).values
        poly = poly.masked_fill(~vec_mask.any(-1, keepdim=True), 0.0)
        return F.normalize(poly, dim=-1)


class VectorNet(nn.Module):
    def __init__(self, in_ch=8, hidden=128, heads=1):
        super().__init__()
        self.subgraph = SubGraph(in_ch, hidden)
        self.proj = nn.Linear(hidden * 2, hidden * 2)
        self.global_attn = nn.MultiheadAttention(hidden * 2, heads, batch_first=True)
        self.traj_head = nn.Sequential(nn.Linear(hidden * 2, 256), nn.ReLU(inplace=True), nn.Linear(256, K * FUT * 2))
        self.score_head = nn.Sequential(nn.Linear(hidden * 2, 64), nn.ReLU(inplace=True), nn.Linear(64, K))

    def forward(self, x, vec_mask, poly_mask):
        poly = self.proj(self.subgraph(x, vec_mask))
        out, _ = self.global_attn(poly, poly, poly, key_padding_mask=~poly_mask)
        focal = out[:, 0]
        trajs = self.traj_head(focal).view(-1, K, FUT, 2)
        return trajs, self.score_head(focal)


def wta_loss(trajs, scores, gt):
    dist_k = torch.norm(trajs - gt.unsqueeze(1), dim=-1).mean(-1)  # (B, K)
    best = dist_k.argmin(dim=1)
    reg = F.smooth_l1_loss(trajs[torch.arange(trajs.shape[0]), best], gt)
    cls = F.cross_entropy(scores, best)
    return reg + cls, reg.detach(), cls.detach()


@torch.no_grad()
def evaluate(net, loader, device, world_size):
    net.eval()
    local = {}
    for batch in loader:
        trajs, _ = net(batch["x"].to(device), batch["vec_mask"].to(device), batch["poly_mask"].to(device))
        gt = batch["future"].to(device).unsqueeze(1)
        err = torch.norm(trajs - gt, dim=-1)  # (B, K, T)
        ade = err.mean(-1).min(-1).values
        fde = err[..., -1].min(-1).values
        for sid, a, f in zip(batch["seq_id"].tolist(), ade.tolist(), fde.tolist()):
            local[sid] = (a, f)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, local)
    merged = {}
    for part in gathered:
        merged.update(part)  # the sampler pads with repeated seq_ids; dict keeps one each
    arr = np.array(list(merged.values()))
    net.train()
    return {"minADE": float(arr[:, 0].mean()), "minFDE": float(arr[:, 1].mean()),
            "MR": float((arr[:, 1] > 2.0).mean()), "n": len(merged)}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(args.seed)
    is_main = rank == 0

    train_ds = ScenarioDataset(args.train_dir, args.max_polylines)
    val_ds = ScenarioDataset(args.val_dir, args.max_polylines)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, drop_last=True,
                              num_workers=args.num_workers, collate_fn=collate_scenarios, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size * 2, sampler=val_sampler,
                            num_workers=args.num_workers, collate_fn=collate_scenarios, pin_memory=True)

    net = VectorNet(hidden=args.hidden).to(device)
    model = DDP(net, device_ids=[local_rank])

    global_batch = args.batch_size * args.accum * world_size
    lr = args.base_lr * global_batch / 256
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    steps_per_epoch = math.ceil(len(train_loader) / args.accum)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * steps_per_epoch)

    start_epoch, best_fde = 0, float("inf")
    if args.resume:
        state = torch.load(args.resume, map_location="cpu")
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        sched.load_state_dict(state["sched"])
        start_epoch, best_fde = state["epoch"] + 1, state["best_fde"]

    if is_main:
        os.makedirs(args.output, exist_ok=True)
        print(f"world={world_size} global_batch={global_batch} lr={lr:.2e} steps/ep={steps_per_epoch}")

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        optimizer.zero_grad(set_to_none=True)
        tic = time.time()
        run = torch.zeros(3, device=device)
        for it, batch in enumerate(train_loader):
            do_step = (it + 1) % args.accum == 0 or (it + 1) == len(train_loader)
            ctx = contextlib.nullcontext() if do_step else model.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    trajs, scores = model(batch["x"].to(device, non_blocking=True),
                                          batch["vec_mask"].to(device, non_blocking=True),
                                          batch["poly_mask"].to(device, non_blocking=True))
                loss, reg, cls = wta_loss(trajs.float(), scores.float(), batch["future"].to(device))
                (loss / args.accum).backward()
            run += torch.stack([loss.detach(), reg, cls])
            if do_step:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                sched.step()
                optimizer.zero_grad(set_to_none=True)
            if (it + 1) % 200 == 0:
                dist.all_reduce(run)
                run /= 200 * world_size
                if is_main:
                    print(f"ep {epoch} it {it + 1}/{len(train_loader)} loss {run[0]:.3f} reg {run[1]:.3f} "
                          f"cls {run[2]:.3f} lr {sched.get_last_lr()[0]:.2e} {time.time() - tic:.0f}s", flush=True)
                run.zero_()

        metrics = evaluate(net, val_loader, device, world_size)
        if is_main:
            print(f"[val] epoch {epoch} " + json.dumps(metrics), flush=True)
            state = {"model": net.state_dict(), "optim": optimizer.state_dict(), "sched": sched.state_dict(),
                     "epoch": epoch, "best_fde": min(best_fde, metrics["minFDE"])}
            torch.save(state, os.path.join(args.output, "last.pt"))
            if metrics["minFDE"] < best_fde:
                torch.save(state, os.path.join(args.output, "best.pt"))
        best_fde = min(best_fde, metrics["minFDE"])
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
