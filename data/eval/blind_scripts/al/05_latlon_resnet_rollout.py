"""Lat-lon residual forecaster (1.0deg ERA5, 6h step) with multi-step autoregressive training.

The rollout length is increased on a curriculum (1 -> max_rollout) as in GraphCast fine-tuning.
Validation scores 5-day forecasts (20 steps) with latitude-weighted RMSE, denormalised per variable.
"""
import argparse
import math
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

VARS = ["z500", "t850", "t2m", "u10", "v10", "msl", "q700", "tp6h"]


class ZarrWindows(Dataset):
    def __init__(self, zarr_path, years, n_steps, stats):
        ds = xr.open_zarr(zarr_path)
        ds = ds.sel(time=ds.time.dt.year.isin(years))
        self.data = ds[VARS].to_array("var").transpose("time", "var", "lat", "lon")
        self.forc = ds[["toa_incident_solar", "land_sea_mask"]].to_array("f").transpose("time", "f", "lat", "lon")
        self.n_steps = n_steps
        self.mean = torch.tensor(stats["mean"]).view(-1, 1, 1)
        self.std = torch.tensor(stats["std"]).view(-1, 1, 1)

    def __len__(self):
        return self.data.sizes["time"] - self.n_steps

    def __getitem__(self, i):
        x = torch.from_numpy(self.data.isel(time=slice(i, i + self.n_steps + 1)).values).float()
        f = torch.from_numpy(self.forc.isel(time=slice(i, i + self.n_steps + 1)).values).float()
        return (x - self.mean) / self.std, f


class PeriodicConv(nn.Conv2d):
    """Circular padding in longitude, replicate padding at the poles."""

    def forward(self, x):
        p = self.kernel_size[0] // 2
        x = F.pad(x, (p, p, 0, 0), mode="circular")
        x = F.pad(x, (0, 0, p, p), mode="replicate")
        return F.conv2d(x, self.weight, self.bias)


class ResBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dw = PeriodicConv(c, c, 7, groups=c)
        self.norm = nn.GroupNorm(8, c)
        self.pw1 = nn.Conv2d(c, 4 * c, 1)
        self.pw2 = nn.Conv2d(4 * c, c, 1)
        self.gamma = nn.Parameter(1e-3 * torch.ones(c, 1, 1))

    def forward(self, x):
        return x + self.gamma * self.pw2(F.gelu(self.pw1(self.norm(self.dw(x)))))


class Forecaster(nn.Module):
    def __init__(self, n_vars, n_forc, width=256, depth=16):
        super().__init__()
        self.n_vars = n_vars
        self.enc = PeriodicConv(n_vars + n_forc, width, 3)
        self.body = nn.Sequential(*[ResBlock(width) for _ in range(depth)])
        self.dec = nn.Conv2d(width, n_vars, 1)
        nn.init.zeros_(self.dec.weight)
        nn.init.zeros_(self.dec.bias)

    def forward(self, x, f):
        return x + self.dec(self.body(self.enc(torch.cat([x, f], 1))))

    @torch.no_grad()
    def rollout(self, x0, forcings, n_steps):
        out, x = [], x0
        for k in range(n_steps):
            x = self(x, forcings[:, k])
            out.append(x)
        return torch.stack(out, 1)


def lat_weight(n_lat, device):
    lat = torch.linspace(-90 + 90 / n_lat, 90 - 90 / n_lat, n_lat, device=device)
    w = torch.cos(torch.deg2rad(lat))
    return (w / w.mean()).view(1, 1, n_lat, 1)


def validate(model, loader, n_steps, std, device):
    model.eval()
    sq = torch.zeros(n_steps, len(VARS), device=device, dtype=torch.float64)
    cnt = torch.zeros((), device=device, dtype=torch.float64)
    w = None
    for x, f in loader:
        x, f = x.to(device, non_blocking=True), f.to(device, non_blocking=True)
        if w is None:
            w = lat_weight(x.shape[-2], device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model.rollout(x[:, 0], f, n_steps)
        err = (pred.float() - x[:, 1:n_steps + 1]) * std  # physical units
        sq += (err ** 2 * w.unsqueeze(1)).mean(dim=(-1, -2)).sum(0).double()
        cnt += x.shape[0]
    dist.all_reduce(sq)
    dist.all_reduce(cnt)
    model.train()
    return torch.sqrt(sq / cnt).cpu()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--zarr", default="/datasets/era5_1deg.zarr")
    ap.add_argument("--stats", default="/datasets/era5_1deg_stats.npz")
    ap.add_argument("--out", default="outputs/latlon_rollout")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--max-rollout", type=int, default=8)
    ap.add_argument("--eval-steps", type=int, default=20)
    ap.add_argument("--val-every", type=int, default=2)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(0)

    st = np.load(args.stats)
    stats = {"mean": st["mean"].tolist(), "std": st["std"].tolist()}
    std = torch.tensor(stats["std"], device=device).view(1, 1, -1, 1, 1)
    train_ds = ZarrWindows(args.zarr, list(range(1979, 2016)), args.max_rollout, stats)
    val_ds = ZarrWindows(args.zarr, [2017], args.eval_steps, stats)
    val_ds = Subset(val_ds, list(range(0, len(val_ds), 12)))  # 00z/12z starts, every 3 days
    val_ds = Subset(val_ds, list(range(rank, len(val_ds), world)))

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch, sampler=sampler, num_workers=8, pin_memory=True,
                          drop_last=True, persistent_workers=True, prefetch_factor=4)
    val_dl = DataLoader(val_ds, 2, num_workers=4, pin_memory=True)

    model = Forecaster(len(VARS), 2, args.width, args.depth).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 1000) * 0.5 * (1 + math.cos(math.pi * s / total)))

    os.makedirs(args.out, exist_ok=True)
    ckpt = os.path.join(args.out, "latest.pt")
    start = 0
    if os.path.exists(ckpt):
        sd = torch.load(ckpt, map_location=device)
        model.module.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])
        sched.load_state_dict(sd["sched"])
        start = sd["epoch"] + 1

    w_train = None
    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        n_roll = min(args.max_rollout, 1 + epoch // 4)
        t0 = time.time()
        for it, (x, f) in enumerate(train_dl):
            x, f = x.to(device, non_blocking=True), f.to(device, non_blocking=True)
            if w_train is None:
                w_train = lat_weight(x.shape[-2], device)
            state = x[:, 0]
            loss = 0.0
            with torch.autocast("cuda", dtype=torch.bfloat16):
                for k in range(n_roll):
                    state = model(state, f[:, k])
                    loss = loss + ((state.float() - x[:, k + 1]) ** 2 * w_train).mean()
            loss = loss / n_roll
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 32.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 200 == 0:
                print(f"[{epoch}:{it}] rollout={n_roll} loss={loss.item():.5f} lr={sched.get_last_lr()[0]:.2e}", flush=True)

        if (epoch + 1) % args.val_every == 0:
            rmse = validate(model, val_dl, args.eval_steps, std, device)
            if rank == 0:
                for lead in (3, 11, 19):
                    vals = ", ".join(f"{v}={rmse[lead, i]:.3f}" for i, v in enumerate(VARS))
                    print(f"  val +{(lead + 1) * 6}h: {vals}")

        if rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch}, ckpt)
            print(f"epoch {epoch} finished in {time.time() - t0:.0f}s")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
