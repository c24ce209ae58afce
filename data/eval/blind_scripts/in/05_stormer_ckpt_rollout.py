"""Stormer-like weather transformer fine-tuned with a K-step autoregressive rollout loss.

Memory is dominated by the K unrolled forwards, so every transformer block is
activation-checkpointed.

    torchrun --nproc_per_node=8 05_stormer_ckpt_rollout.py --pretrained runs/stormer_1step/best.pt
"""
import argparse
import json
import math
import os
import time
from datetime import datetime

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.checkpoint as cp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/datasets/era5_1.40625/era5_6h_69ch.f32")
    p.add_argument("--meta", default="/datasets/era5_1.40625/meta.json")
    p.add_argument("--pretrained", default="")
    p.add_argument("--out", default="runs/stormer_rollout")
    p.add_argument("--rollout", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=5e-6)
    p.add_argument("--steps", type=int, default=20000)
    p.add_argument("--eval-every", type=int, default=1000)
    p.add_argument("--embed-dim", type=int, default=1024)
    p.add_argument("--depth", type=int, default=24)
    p.add_argument("--grad-ckpt", type=int, default=1)
    return p.parse_args()


class Era5Memmap(Dataset):
    def __init__(self, path, meta, start, end, rollout):
        self.meta = meta
        shape = (meta["n_times"], meta["n_channels"], meta["n_lat"], meta["n_lon"])
        self.arr = np.memmap(path, dtype=np.float32, mode="r", shape=shape)
        t0 = datetime.fromisoformat(meta["first_time"])
        hours = lambda d: int((datetime.fromisoformat(d) - t0).total_seconds() // 3600)
        self.lo, self.hi = hours(start) // 6, hours(end) // 6
        self.rollout = rollout
        self.mean = np.array(meta["mean"], dtype=np.float32)[:, None, None]
        self.std = np.array(meta["std"], dtype=np.float32)[:, None, None]

    def __len__(self):
        return self.hi - self.lo - self.rollout

    def __getitem__(self, i):
        t = self.lo + i
        x = (np.array(self.arr[t:t + self.rollout + 1]) - self.mean) / self.std
        return torch.from_numpy(x)


class AdaLNBlock(nn.Module):
    """Transformer block conditioned on the lead time through adaptive layer norm."""

    def __init__(self, dim, heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def forward(self, x, c):
        s1, b1, g1, s2, b2, g2 = self.ada(c).unsqueeze(1).chunk(6, dim=-1)
        h = self.norm1(x) * (1 + s1) + b1
        x = x + g1 * self.attn(h, h, h, need_weights=False)[0]
        h = self.norm2(x) * (1 + s2) + b2
        return x + g2 * self.mlp(h)


class Stormer(nn.Module):
    def __init__(self, n_ch, img, patch=2, dim=1024, depth=24, heads=16, grad_ckpt=True):
        super().__init__()
        self.n_ch, self.patch = n_ch, patch
        self.gh, self.gw = img[0] // patch, img[1] // patch
        self.embed = nn.Conv2d(n_ch, dim, patch, patch)
        self.pos = nn.Parameter(torch.randn(1, self.gh * self.gw, dim) * 0.02)
        self.lead_embed = nn.Sequential(nn.Linear(1, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList([AdaLNBlock(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, n_ch * patch * patch)
        self.grad_ckpt = grad_ckpt

    def forward(self, x, lead_hours=6.0):
        B, C, H, W = x.shape
        h = self.embed(x).flatten(2).transpose(1, 2) + self.pos
        c = self.lead_embed(torch.full((B, 1), lead_hours / 100.0, device=x.device, dtype=x.dtype))
        for blk in self.blocks:
            if self.grad_ckpt and self.training:
                h = cp.checkpoint(blk, h, c, use_reentrant=True)
            else:
                h = blk(h, c)
        out = self.head(self.norm(h)).view(B, self.gh, self.gw, C, self.patch, self.patch)
        out = out.permute(0, 3, 1, 4, 2, 5).reshape(B, C, H, W)
        return x + out


def latitude_weights(n_lat, device):
    lat = np.linspace(-90 + 90 / n_lat, 90 - 90 / n_lat, n_lat)
    w = np.cos(np.deg2rad(lat))
    return torch.tensor(w / w.mean(), dtype=torch.float32, device=device).view(1, 1, -1, 1)


@torch.no_grad()
def evaluate(net, loader, w, std, var_idx, rollout, device):
    net.eval()
    acc = torch.zeros(rollout, len(var_idx), dtype=torch.float64, device=device)
    n = torch.zeros((), dtype=torch.float64, device=device)
    for seq in loader:
        seq = seq.to(device, non_blocking=True)
        x = seq[:, 0]
        for k in range(rollout):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                x = net(x).float()
            se = ((x - seq[:, k + 1]) * std) ** 2
            acc[k] += (se * w).mean(dim=(-2, -1)).sqrt()[:, var_idx].sum(0).double()
        n += seq.shape[0]
    dist.all_reduce(acc)
    dist.all_reduce(n)
    net.train()
    return (acc / n).cpu().numpy()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    with open(args.meta) as f:
        meta = json.load(f)
    train_ds = Era5Memmap(args.data, meta, "1979-01-01", "2018-01-01", args.rollout)
    val_full = Era5Memmap(args.data, meta, "2018-01-01", "2019-01-01", args.rollout)
    val_ds = Subset(val_full, range(rank, len(val_full), 8 * world))  # every 8th init, sharded

    per_gpu = args.global_batch // world
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True, seed=0)
    train_dl = DataLoader(train_ds, batch_size=per_gpu, sampler=sampler, num_workers=8,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=per_gpu, num_workers=4, pin_memory=True)

    net = Stormer(meta["n_channels"], (meta["n_lat"], meta["n_lon"]), dim=args.embed_dim,
                  depth=args.depth, grad_ckpt=bool(args.grad_ckpt))
    if args.pretrained:
        sd = torch.load(args.pretrained, map_location="cpu")["model"]
        missing, unexpected = net.load_state_dict(sd, strict=False)
        if rank == 0:
            print(f"loaded {args.pretrained}: missing={missing} unexpected={unexpected}")
    net = net.to(device)
    model = DDP(net, device_ids=[local_rank], gradient_as_bucket_view=True)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 500) * 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    w = latitude_weights(meta["n_lat"], device)
    std = torch.tensor(meta["std"], dtype=torch.float32, device=device).view(1, -1, 1, 1)
    var_idx = [meta["channels"].index(v) for v in ("geopotential_500", "temperature_850", "2m_temperature")]
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    step, epoch, best = 0, 0, float("inf")
    t0 = time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for seq in train_dl:
            seq = seq.to(device, non_blocking=True)
            x = seq[:, 0]
            loss = 0.0
            with torch.autocast("cuda", dtype=torch.bfloat16):
                for k in range(args.rollout):
                    x = model(x)
                    loss = loss + ((x.float() - seq[:, k + 1]) ** 2 * w).mean()
            loss = loss / args.rollout
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1

            if rank == 0 and step % 50 == 0:
                print(f"step {step} loss {loss.item():.5f} lr {sched.get_last_lr()[0]:.2e} "
                      f"{(time.time() - t0) / 50:.2f}s/step", flush=True)
                t0 = time.time()
            if step % args.eval_every == 0 or step == args.steps:
                rmse = evaluate(net, val_dl, w, std, var_idx, args.rollout, device)
                if rank == 0:
                    for k in range(args.rollout):
                        print(f"  +{6 * (k + 1)}h z500 {rmse[k, 0]:.1f} t850 {rmse[k, 1]:.3f} t2m {rmse[k, 2]:.3f}")
                    state = {"model": net.state_dict(), "opt": opt.state_dict(), "step": step}
                    torch.save(state, os.path.join(args.out, "last.pt"))
                    if rmse[-1, 0] < best:
                        best = rmse[-1, 0]
                        torch.save(state, os.path.join(args.out, "best.pt"))
                dist.barrier()
            if step >= args.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
