#!/usr/bin/env python
"""WeatherBench (5.625 deg) U-Net with an autoregressive rollout loss.

torchrun --nproc_per_node=4 04_unet_weatherbench.py --zarr /data/weatherbench/5.625deg.zarr
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import xarray as xr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

VARS = {"z": [300, 500, 700, 850], "t": [500, 850], "u": [500, 850], "v": [500, 850], "t2m": None}
SCORE_VARS = ["z_500", "t_850", "t2m"]


def load_split(path, start, end):
    # hourly store, keep 00/06/12/18 UTC
    ds = xr.open_zarr(path).sel(time=slice(start, end))
    ds = ds.sel(time=ds.time.dt.hour.isin([0, 6, 12, 18]))
    arrays, names = [], []
    for var, levels in VARS.items():
        if levels is None:
            arrays.append(ds[var].values[:, None])
            names.append(var)
        else:
            arrays.append(ds[var].sel(level=levels).values)
            names.extend(f"{var}_{l}" for l in levels)
    return np.concatenate(arrays, axis=1).astype(np.float32), names, ds["lat"].values


class RolloutDataset(Dataset):
    def __init__(self, data, mean, std, steps, stride=1):
        self.data = (data - mean) / std
        self.steps, self.stride = steps, stride

    def __len__(self):
        return self.data.shape[0] - self.steps * self.stride

    def __getitem__(self, i):
        idx = i + self.stride * np.arange(self.steps + 1)
        x = self.data[idx]
        return torch.from_numpy(x[0]), torch.from_numpy(x[1:])


def conv_block(cin, cout):
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=(1, 0)), nn.GroupNorm(8, cout), nn.GELU(),
        nn.Conv2d(cout, cout, 3, padding=(1, 0)), nn.GroupNorm(8, cout), nn.GELU())


class PeriodicConv(nn.Module):
    """Wrap longitude periodically before each conv stack."""

    def __init__(self, cin, cout):
        super().__init__()
        self.block = conv_block(cin, cout)

    def forward(self, x):
        x = F.pad(x, (2, 2, 0, 0), mode="circular")
        return self.block(x)


class UNet(nn.Module):
    def __init__(self, channels, width=64):
        super().__init__()
        self.enc1 = PeriodicConv(channels, width)
        self.enc2 = PeriodicConv(width, 2 * width)
        self.enc3 = PeriodicConv(2 * width, 4 * width)
        self.mid = PeriodicConv(4 * width, 4 * width)
        self.up2 = nn.ConvTranspose2d(4 * width, 2 * width, 2, stride=2)
        self.dec2 = PeriodicConv(4 * width, 2 * width)
        self.up1 = nn.ConvTranspose2d(2 * width, width, 2, stride=2)
        self.dec1 = PeriodicConv(2 * width, width)
        self.out = nn.Conv2d(width, channels, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        e3 = self.enc3(F.max_pool2d(e2, 2))
        m = self.mid(e3)
        d2 = self.dec2(torch.cat([self.up2(m), e2], 1))
        d1 = self.dec1(torch.cat([self.up1(d2), e1], 1))
        return x + self.out(d1)


def rollout_loss(model, x, ys, w):
    loss = 0.0
    for k in range(ys.shape[1]):
        x = model(x)
        loss = loss + ((x - ys[:, k]) ** 2 * w).mean()
    return loss / ys.shape[1]


@torch.no_grad()
def evaluate(net, loader, w, std, idx, device):
    """Lat-weighted RMSE of the final rollout step, in physical units."""
    net.eval()
    sums = torch.zeros(len(idx), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    for x, ys in loader:
        x, ys = x.to(device), ys.to(device)
        for k in range(ys.shape[1]):
            x = net(x)
        err = ((x - ys[:, -1]) * std) ** 2
        rmse = (err * w).mean(dim=(-2, -1)).sqrt()[:, idx]
        sums += rmse.sum(0).double()
        count += x.shape[0]
    dist.all_reduce(sums)
    dist.all_reduce(count)
    net.train()
    return (sums / count).tolist()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--zarr", required=True)
    ap.add_argument("--out", default="checkpoints/unet_wb")
    ap.add_argument("--batch-size", type=int, default=32, help="per GPU")
    ap.add_argument("--base-lr", type=float, default=2e-4, help="for a global batch of 32")
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--train-steps", type=int, default=4)
    ap.add_argument("--eval-steps", type=int, default=12)
    ap.add_argument("--width", type=int, default=64)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_np, names, lat = load_split(args.zarr, "1979", "2015")
    val_np, _, _ = load_split(args.zarr, "2016", "2016")
    mean = train_np.mean(axis=(0, 2, 3), keepdims=True)[0]
    std = train_np.std(axis=(0, 2, 3), keepdims=True)[0]

    train_ds = RolloutDataset(train_np, mean, std, args.train_steps)
    val_all = RolloutDataset(val_np, mean, std, args.eval_steps)
    val_ds = Subset(val_all, range(rank, len(val_all), world))

    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size, num_workers=4, pin_memory=True)

    net = UNet(len(names), args.width).to(device)
    model = DDP(net, device_ids=[local_rank])
    lr = args.base_lr * args.batch_size * world / 32
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=args.epochs * len(train_dl),
                                                pct_start=0.05)

    w = torch.cos(torch.deg2rad(torch.tensor(lat, dtype=torch.float32, device=device)))
    w = (w / w.mean()).view(1, 1, -1, 1)
    std_t = torch.tensor(std, device=device).unsqueeze(0)
    score_idx = [names.index(v) for v in SCORE_VARS]

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        np.savez(os.path.join(args.out, "norm.npz"), mean=mean, std=std, names=np.array(names))
        print(f"{len(names)} channels, {len(train_ds)} train samples, lr={lr:.2e}, world={world}")

    best = float("inf")
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for x, ys in train_dl:
            x = x.to(device, non_blocking=True)
            ys = ys.to(device, non_blocking=True)
            loss = rollout_loss(model, x, ys, w)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(running)
        scores = evaluate(net, val_dl, w, std_t, score_idx, device)

        if rank == 0:
            hours = 6 * args.eval_steps
            msg = " ".join(f"{n}@{hours}h={s:.3f}" for n, s in zip(SCORE_VARS, scores))
            print(f"epoch {epoch:3d} train {running[0] / running[1]:.4f} {msg} ({time.time() - t0:.0f}s)",
                  flush=True)
            ckpt = {"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                    "epoch": epoch, "names": names}
            torch.save(ckpt, os.path.join(args.out, "last.pt"))
            if scores[0] < best:
                best = scores[0]
                torch.save(ckpt, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
