"""Stormer-lite: ViT with lead-time conditioning (adaLN) trained on randomised
6/12/24 h intervals; at inference the 1-5 day forecasts are built by combining
rollouts of different intervals. Long jobs are preempted, hence the resume logic.

Slurm: srun --ntasks-per-node=1 torchrun --nnodes=$SLURM_NNODES --nproc_per_node=4 \
          --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 08_stormer_lite_resume.py ...
"""
import argparse
import glob
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import xarray as xr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

INTERVALS = (1, 2, 4)  # in 6 h steps


class MultiIntervalDataset(Dataset):
    def __init__(self, zarr, years, variables, stats):
        ds = xr.open_zarr(zarr)
        ds = ds.sel(time=ds.time.dt.year.isin(years))
        self.arr = ds[variables].to_array("v").transpose("time", "v", "lat", "lon")
        self.m = stats["mean"][:, None, None].astype(np.float32)
        self.s = stats["std"][:, None, None].astype(np.float32)
        self.max_dt = max(INTERVALS)

    def __len__(self):
        return self.arr.sizes["time"] - self.max_dt

    def __getitem__(self, i):
        dt = random.choice(INTERVALS)
        x = (self.arr.isel(time=i).values - self.m) / self.s
        y = (self.arr.isel(time=i + dt).values - self.m) / self.s
        return torch.from_numpy(x.astype(np.float32)), torch.from_numpy(y.astype(np.float32)), torch.tensor(dt)


class AdaLNBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.n1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.n2 = nn.LayerNorm(dim, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        nn.init.zeros_(self.ada[1].weight)
        nn.init.zeros_(self.ada[1].bias)

    def forward(self, x, c):
        s1, b1, g1, s2, b2, g2 = self.ada(c).unsqueeze(1).chunk(6, dim=-1)
        h = self.n1(x) * (1 + s1) + b1
        x = x + g1 * self.attn(h, h, h, need_weights=False)[0]
        h = self.n2(x) * (1 + s2) + b2
        return x + g2 * self.mlp(h)


class StormerLite(nn.Module):
    def __init__(self, n_vars, img=(128, 256), patch=2, dim=768, depth=16, heads=12):
        super().__init__()
        self.p, self.n_vars = patch, n_vars
        self.gh, self.gw = img[0] // patch, img[1] // patch
        self.embed = nn.Conv2d(n_vars, dim, patch, patch)
        self.pos = nn.Parameter(torch.zeros(1, self.gh * self.gw, dim))
        self.dt_embed = nn.Embedding(max(INTERVALS) + 1, dim)
        self.blocks = nn.ModuleList([AdaLNBlock(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, n_vars * patch * patch)
        nn.init.trunc_normal_(self.pos, std=0.02)

    def forward(self, x, dt):
        B = x.shape[0]
        t = self.embed(x).flatten(2).transpose(1, 2) + self.pos
        c = self.dt_embed(dt)
        for blk in self.blocks:
            t = blk(t, c)
        t = self.head(self.norm(t)).view(B, self.gh, self.gw, self.p, self.p, self.n_vars)
        t = t.permute(0, 5, 1, 3, 2, 4).reshape(B, self.n_vars, self.gh * self.p, self.gw * self.p)
        return x + t


def latitude_weights(n_lat, device):
    lat = torch.linspace(-90 + 90 / n_lat, 90 - 90 / n_lat, n_lat, device=device)
    w = torch.cos(torch.deg2rad(lat))
    return (w / w.mean())[None, None, :, None]


def latest_checkpoint(ckpt_dir):
    ckpts = sorted(glob.glob(os.path.join(ckpt_dir, "step_*.pt")))
    return ckpts[-1] if ckpts else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--zarr", default="/project/wx/era5/1p40625deg.zarr")
    ap.add_argument("--stats", default="/project/wx/era5/1p40625deg_stats_1979_2017.npz")
    ap.add_argument("--ckpt_dir", default="/project/wx/runs/stormer_lite/ckpt")
    ap.add_argument("--vars", nargs="+", default=["z500", "t850", "t2m", "u10", "v10", "msl", "q700",
                                                   "u850", "v850", "z250", "t500", "u250", "v250"])
    ap.add_argument("--max_steps", type=int, default=200_000)
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=5000)
    ap.add_argument("--save_every", type=int, default=2000)
    ap.add_argument("--eval_every", type=int, default=5000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    stats = np.load(args.stats)
    train_ds = MultiIntervalDataset(args.zarr, list(range(1979, 2018)), args.vars, stats)
    val_ds = MultiIntervalDataset(args.zarr, [2018], args.vars, stats)
    val_ds = torch.utils.data.Subset(val_ds, list(range(rank, len(val_ds), 6 * world)))
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=10,
                          pin_memory=True, persistent_workers=True,
                          worker_init_fn=lambda wid: random.seed(torch.initial_seed() % 2**32 + wid))
    val_dl = DataLoader(val_ds, batch_size=args.batch_size, num_workers=4)

    model = StormerLite(len(args.vars)).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + np.cos(np.pi * min(s, args.max_steps) / args.max_steps)))
    aw = latitude_weights(128, device)

    step, epoch = 0, 0
    resume_path = latest_checkpoint(args.ckpt_dir)
    if resume_path is not None:
        state = torch.load(resume_path)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        step, epoch = state["step"], state["epoch"]
        if rank == 0:
            print(f"resumed from {resume_path} at step {step}", flush=True)
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    t0 = time.time()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        model.train()
        for x, y, dt in train_dl:
            x, y, dt = x.to(device, non_blocking=True), y.to(device, non_blocking=True), dt.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(x, dt)
            loss = (aw * (pred.float() - y) ** 2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1

            if rank == 0 and step % 100 == 0:
                print(f"step {step} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                      f"{(time.time() - t0) / 100:.2f}s/it", flush=True)
                t0 = time.time()

            if step % args.eval_every == 0:
                model.eval()
                tot = torch.zeros(len(args.vars) + 1, device=device, dtype=torch.float64)
                with torch.no_grad():
                    for vx, vy, vdt in val_dl:
                        vx, vy, vdt = vx.to(device), vy.to(device), vdt.to(device)
                        with torch.autocast("cuda", dtype=torch.bfloat16):
                            vp = model.module(vx, vdt)
                        tot[:-1] += (aw * (vp.float() - vy) ** 2).mean(dim=(-2, -1)).sum(0).double()
                        tot[-1] += vx.shape[0]
                dist.all_reduce(tot)
                if rank == 0:
                    rmse = torch.sqrt(tot[:-1] / tot[-1])
                    print("val rmse (norm.) " + " ".join(f"{v}={r:.4f}" for v, r in zip(args.vars, rmse.tolist())),
                          flush=True)
                model.train()

            if step % args.save_every == 0 and rank == 0:
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                            "sched": sched.state_dict(), "step": step, "epoch": epoch},
                           os.path.join(args.ckpt_dir, f"step_{step:07d}.pt"))
            if step >= args.max_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
