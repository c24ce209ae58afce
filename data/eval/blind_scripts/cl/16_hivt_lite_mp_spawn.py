"""HiVT-lite multi-agent forecasting, single-node multi-GPU via torch.multiprocessing.spawn.

    python 16_hivt_lite_mp_spawn.py --gpus 4 --data /data/argoverse1/hivt_cache

Besides mean minADE/minFDE over all agents, the validation reports FDE percentiles,
so per-agent errors are gathered from every rank.
"""
import argparse
import os
import pickle
import socket
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

HIST, FUT, MODES = 20, 30, 6


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--data", default="/data/argoverse1/hivt_cache")
    p.add_argument("--save", default="/data/runs/hivt_lite")
    p.add_argument("--embed", type=int, default=64)
    p.add_argument("--radius", type=float, default=50.0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-4, help="for global batch 32 (HiVT default)")
    p.add_argument("--workers", type=int, default=6)
    return p.parse_args()


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HiVTCache(Dataset):
    def __init__(self, root, split):
        with open(os.path.join(root, f"{split}.pkl"), "rb") as f:
            self.items = pickle.load(f)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        return (torch.from_numpy(it["x"]).float(),          # (A, 20, 2) displacements, rotated to the AV heading
                torch.from_numpy(it["pos"]).float(),        # (A, 2) positions at t=19
                torch.from_numpy(it["padding"]).bool(),     # (A, 50) True where the agent is missing
                torch.from_numpy(it["y"]).float())          # (A, 30, 2) future relative to t=19


def collate(batch):
    A = max(b[0].shape[0] for b in batch)
    B = len(batch)
    x, pos = torch.zeros(B, A, HIST, 2), torch.zeros(B, A, 2)
    pad = torch.ones(B, A, HIST + FUT, dtype=torch.bool)
    y = torch.zeros(B, A, FUT, 2)
    for i, (xi, pi, padi, yi) in enumerate(batch):
        n = xi.shape[0]
        x[i, :n], pos[i, :n], pad[i, :n], y[i, :n] = xi, pi, padi, yi
    return x, pos, pad, y


class HiVTLite(nn.Module):
    def __init__(self, d=64, radius=50.0):
        super().__init__()
        self.radius = radius
        self.center_emb = nn.Sequential(nn.Linear(2, d), nn.LayerNorm(d), nn.ReLU(), nn.Linear(d, d))
        self.nbr_emb = nn.Sequential(nn.Linear(4, d), nn.LayerNorm(d), nn.ReLU(), nn.Linear(d, d))
        self.local_attn = nn.MultiheadAttention(d, 8, batch_first=True)
        self.temporal = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 8, 4 * d, 0.1, batch_first=True), 2)
        self.global_attn = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 8, 4 * d, 0.1, batch_first=True), 2)
        self.loc = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, MODES * FUT * 2))
        self.scale = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, MODES * FUT * 2))
        self.pi = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, MODES))

    def forward(self, x, pos, pad):
        B, A, T, _ = x.shape
        hist_pad = pad[..., :HIST]
        valid_now = ~hist_pad[..., -1]
        # agent-agent interaction at every step: neighbours within radius, features relative to the centre
        ctr = self.center_emb(x)                                              # (B, A, T, d)
        rel = pos[:, None, :, :] - pos[:, :, None, :]                        # (B, A, A, 2)
        near = (rel.norm(dim=-1) < self.radius) & valid_now[:, None, :]      # (B, A, A)
        nbr_in = torch.cat([x[:, None].expand(-1, A, -1, -1, -1), rel[:, :, :, None].expand(-1, -1, -1, T, -1)], -1)
        nbr = self.nbr_emb(nbr_in).permute(0, 1, 3, 2, 4).reshape(B * A * T, A, -1)
        kpm = ~(near[:, :, None, :].expand(-1, -1, T, -1) & ~hist_pad[:, None, :, :].transpose(2, 3)).reshape(B * A * T, A)
        kpm[:, 0] = False  # avoid fully masked rows; slot 0 is the focal/AV track, always present
        q = ctr.reshape(B * A * T, 1, -1)
        loc, _ = self.local_attn(q, nbr, nbr, key_padding_mask=kpm)
        h = (ctr + loc.view(B, A, T, -1)).reshape(B * A, T, -1)
        h = self.temporal(h, src_key_padding_mask=hist_pad.reshape(B * A, T) & ~hist_pad.reshape(B * A, T).all(-1, keepdim=True))
        h = h[:, -1].view(B, A, -1)
        g = self.global_attn(h, src_key_padding_mask=~valid_now)
        loc = self.loc(g).view(B, A, MODES, FUT, 2).cumsum(3)
        scale = F.elu(self.scale(g).view(B, A, MODES, FUT, 2)) + 1.0 + 1e-3
        return loc, scale, self.pi(g)


def hivt_loss(loc, scale, pi, y, pad):
    fut_valid = ~pad[..., HIST:]                                   # (B, A, 30)
    m = fut_valid.any(-1) & ~pad[..., HIST - 1]
    loc, scale, pi, y, fv = loc[m], scale[m], pi[m], y[m], fut_valid[m].float()
    l2 = (torch.norm(loc - y[:, None], dim=-1) * fv[:, None]).sum(-1)
    best = l2.argmin(-1)
    ar = torch.arange(len(best), device=y.device)
    nll = (torch.log(2 * scale[ar, best]) + (y - loc[ar, best]).abs() / scale[ar, best]).sum(-1)
    reg = (nll * fv).sum() / fv.sum().clamp(min=1)
    soft = F.softmax(-l2 / fv.sum(-1, keepdim=True).clamp(min=1), dim=-1).detach()
    cls = -(soft * F.log_softmax(pi, -1)).sum(-1).mean()
    return reg + cls


def gather_variable(t, world_size):
    """all_gather for tensors whose first dimension differs between ranks."""
    n = torch.tensor([t.shape[0]], device=t.device, dtype=torch.long)
    sizes = [torch.zeros_like(n) for _ in range(world_size)]
    dist.all_gather(sizes, n)
    sizes = [int(s.item()) for s in sizes]
    padded = t.new_zeros((max(sizes), *t.shape[1:]))
    padded[: t.shape[0]] = t
    out = [torch.zeros_like(padded) for _ in range(world_size)]
    dist.all_gather(out, padded)
    return torch.cat([o[:s] for o, s in zip(out, sizes)])


@torch.no_grad()
def evaluate(net, loader, device, world_size):
    net.eval()
    ades, fdes = [], []
    for x, pos, pad, y in loader:
        x, pos, pad, y = x.to(device), pos.to(device), pad.to(device), y.to(device)
        loc, _, _ = net(x, pos, pad)
        full = (~pad[..., HIST:]).all(-1) & ~pad[..., HIST - 1]
        err = torch.norm(loc[full] - y[full][:, None], dim=-1)
        ades.append(err.mean(-1).min(-1).values)
        fdes.append(err[..., -1].min(-1).values)
    ade = gather_variable(torch.cat(ades), world_size)
    fde = gather_variable(torch.cat(fdes), world_size)
    net.train()
    q = torch.quantile(fde.float(), torch.tensor([0.5, 0.9, 0.99], device=device))
    return {"minADE": ade.mean().item(), "minFDE": fde.mean().item(), "MR": (fde > 2).float().mean().item(),
            "FDE_p50": q[0].item(), "FDE_p90": q[1].item(), "FDE_p99": q[2].item(), "agents": fde.numel()}


def worker(rank, world_size, port, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(1234)

    train_set, val_set = HiVTCache(args.data, "train"), HiVTCache(args.data, "val")
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, collate_fn=collate,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world_size)),
                            args.batch_size, collate_fn=collate, num_workers=args.workers)

    net = HiVTLite(args.embed, args.radius).to(device)
    model = DDP(net, device_ids=[rank])
    lr = args.lr * args.batch_size * world_size / 32
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    if rank == 0:
        os.makedirs(args.save, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for x, pos, pad, y in train_loader:
            x, pos = x.to(device, non_blocking=True), pos.to(device, non_blocking=True)
            pad, y = pad.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loc, scale, pi = model(x, pos, pad)
            loss = hivt_loss(loc, scale, pi, y, pad)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(tot)
        res = evaluate(net, val_loader, device, world_size)
        if rank == 0:
            print(f"epoch {epoch} loss {(tot[0] / tot[1]).item():.3f} " +
                  " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()) +
                  f" [{time.time() - t0:.0f}s]", flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.save, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    args = get_args()
    assert 1 <= args.gpus <= torch.cuda.device_count(), f"asked for {args.gpus} GPUs"
    mp.spawn(worker, args=(args.gpus, free_port(), args), nprocs=args.gpus, join=True)
