"""FengWu-style forecaster (one encoder per variable group, shared fusion transformer) fine-tuned
on the recent ERA5 years 2019-2023 only. 10% of the ISO weeks are held out for validation so
that validation covers every season; whole weeks are held out to limit temporal leakage.

    torchrun --nproc_per_node=8 18_fengwu_recent_years.py --zarr /scratch/era5_recent_1p5.zarr \
        --init /scratch/runs/fengwu_base/best.pt
"""
import argparse
import math
import os
import random
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import zarr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

GROUPS = {"z": 13, "q": 13, "u": 13, "v": 13, "t": 13, "surface": 4}


class PairSet(Dataset):
    def __init__(self, store, starts, rollout, mean, std):
        self.store, self.starts, self.rollout = store, np.asarray(starts), rollout
        self.mean, self.std = mean[:, None, None], std[:, None, None]
        self.arr = None

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        if self.arr is None:
            self.arr = zarr.open(self.store, mode="r")["fields"]
        t = int(self.starts[i])
        seq = (self.arr[t:t + self.rollout + 1].astype(np.float32) - self.mean) / self.std
        return torch.from_numpy(seq)


class GroupEncoder(nn.Module):
    def __init__(self, cin, dim, patch):
        super().__init__()
        self.proj = nn.Conv2d(cin, dim, patch, patch)
        self.block = nn.TransformerEncoderLayer(dim, 8, 4 * dim, 0.0, "gelu", batch_first=True, norm_first=True)

    def forward(self, x):
        return self.block(self.proj(x).flatten(2).transpose(1, 2))


class FengWuLite(nn.Module):
    def __init__(self, img=(120, 240), patch=4, dim=384, fuse_depth=8):
        super().__init__()
        self.p = patch
        self.gh, self.gw = img[0] // patch, img[1] // patch
        self.enc = nn.ModuleDict({g: GroupEncoder(c, dim, patch) for g, c in GROUPS.items()})
        self.fuse_in = nn.Linear(dim * len(GROUPS), 2 * dim)
        layer = nn.TransformerEncoderLayer(2 * dim, 16, 8 * dim, 0.0, "gelu", batch_first=True, norm_first=True)
        self.fuse = nn.TransformerEncoder(layer, fuse_depth, enable_nested_tensor=False)
        self.pos = nn.Parameter(torch.zeros(1, self.gh * self.gw, 2 * dim))
        self.dec = nn.ModuleDict({g: nn.Linear(2 * dim, c * patch * patch) for g, c in GROUPS.items()})

    def forward(self, x):
        B, C, H, W = x.shape
        parts, c0 = [], 0
        for g, c in GROUPS.items():
            parts.append(self.enc[g](x[:, c0:c0 + c]))
            c0 += c
        h = self.fuse(self.fuse_in(torch.cat(parts, dim=-1)) + self.pos)
        outs = []
        for g, c in GROUPS.items():
            o = self.dec[g](h).view(B, self.gh, self.gw, c, self.p, self.p).permute(0, 3, 1, 4, 2, 5)
            outs.append(o.reshape(B, c, H, W))
        return x + torch.cat(outs, dim=1)


def lat_weights(device):
    lat = np.linspace(90, -88.5, 120)            # 1.5 deg, south pole row dropped
    w = np.cos(np.deg2rad(lat))
    return torch.tensor(w / w.mean(), dtype=torch.float32, device=device).view(1, 1, -1, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--zarr", required=True)
    ap.add_argument("--init", default="")
    ap.add_argument("--out", default="/scratch/runs/fengwu_recent")
    ap.add_argument("--rollout", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--val-frac", type=float, default=0.1)
    ap.add_argument("--noise", type=float, default=0.02, help="input perturbation, in std units")
    ap.add_argument("--seed", type=int, default=2024)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # different input perturbations on every rank
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    root = zarr.open(args.zarr, mode="r")
    times = pd.to_datetime(root["time"][:].astype("datetime64[ns]"))
    mean = root["mean"][:].astype(np.float32)
    std = root["std"][:].astype(np.float32)
    iso = times.isocalendar()
    week_id = (iso.year.values * 100 + iso.week.values)[: len(times) - args.rollout]
    weeks = np.unique(week_id)
    val_weeks = np.random.choice(weeks, size=int(round(args.val_frac * len(weeks))), replace=False)
    is_val = np.isin(week_id, val_weeks)
    train_starts = np.nonzero(~is_val)[0]
    val_starts = np.nonzero(is_val & (times.hour.values[: len(week_id)] % 12 == 0))[0]

    train_ds = PairSet(args.zarr, train_starts, args.rollout, mean, std)
    val_full = PairSet(args.zarr, val_starts, args.rollout, mean, std)
    val_ds = Subset(val_full, range(rank, len(val_full), world))
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.batch, sampler=sampler, num_workers=6,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch, num_workers=4, pin_memory=True)

    net = FengWuLite()
    if args.init:
        net.load_state_dict(torch.load(args.init, map_location="cpu")["model"])
    net.to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * world * args.batch / 32, weight_decay=0.01)
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))
    w = lat_weights(device)
    std_t = torch.from_numpy(std).to(device).view(1, -1, 1, 1)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(weeks)} weeks, {len(val_weeks)} held out; train {len(train_ds)} val {len(val_full)}")

    best = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, seq in enumerate(train_dl):
            seq = seq[:, :, :, :120].to(device, non_blocking=True)
            x = seq[:, 0] + args.noise * torch.randn_like(seq[:, 0])
            loss = 0.0
            with torch.autocast("cuda", dtype=torch.bfloat16):
                for k in range(args.rollout):
                    x = model(x)
                    loss = loss + ((x.float() - seq[:, k + 1]) ** 2 * w).mean()
            loss = loss / args.rollout
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 50 == 0:
                print(f"ep {epoch} it {it} loss {loss.item():.4f}", flush=True)

        net.eval()
        acc = torch.zeros(3, dtype=torch.float64, device=device)
        with torch.no_grad():
            for seq in val_dl:
                seq = seq[:, :, :, :120].to(device)
                x = seq[:, 0]
                for k in range(args.rollout):
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        x = net(x).float()
                r = ((((x - seq[:, -1]) * std_t) ** 2) * w).mean(dim=(-2, -1)).sqrt()
                acc[0] += r[:, 7].sum().double()              # z500
                acc[1] += r[:, 13 * 4 + 10].sum().double()    # t850
                acc[2] += seq.shape[0]
        dist.all_reduce(acc)
        z500, t850 = (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s) val@{6 * args.rollout}h z500 {z500:.1f} "
                  f"t850 {t850:.3f}", flush=True)
            torch.save({"model": net.state_dict(), "epoch": epoch}, os.path.join(args.out, "last.pt"))
            if z500 < best:
                torch.save({"model": net.state_dict(), "epoch": epoch}, os.path.join(args.out, "best.pt"))
        best = min(best, z500)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
