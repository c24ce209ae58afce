"""ResUNet (BatchNorm) for 24 h forecasts of t2m, tp24, msl, z500 from 1.0 deg ERA5 + ERA5T.

A few time steps of the merged archive contain missing (NaN) fields;
such batches are dropped on all ranks together.
Per-variable normalisation statistics are computed once from the training
years and cached in the run directory.

    torchrun --standalone --nproc_per_node=4 16_unet_syncbn_era5t.py --run_dir /shared/wx/runs/resunet_24h
"""
import argparse
import datetime
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
import xarray as xr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

IN_VARS = ["t2m", "tp6", "msl", "z500", "t850", "q850", "u850", "v850", "tcwv", "sst_filled"]
OUT_VARS = ["t2m", "tp24", "msl", "z500"]
TRAIN = ("1979-01-01", "2016-12-31")
VALID = ("2018-01-01", "2018-12-31")


def compute_stats(nc_glob, variables):
    ds = xr.open_mfdataset(nc_glob, combine="by_coords").sel(time=slice(*TRAIN)).isel(time=slice(0, None, 7))
    mean = np.array([float(ds[v].mean()) for v in variables], dtype=np.float32)
    std = np.array([float(ds[v].std()) for v in variables], dtype=np.float32)
    return mean, std


def load_or_build_stats(run_dir, nc_glob, rank):
    path = os.path.join(run_dir, "norm_stats.npz")
    if rank == 0 and not os.path.exists(path):
        variables = sorted(set(IN_VARS) | set(OUT_VARS))
        mean, std = compute_stats(nc_glob, variables)
        np.savez(path + ".tmp.npz", names=np.array(variables), mean=mean, std=std)
        os.replace(path + ".tmp.npz", path)
    dist.barrier()
    st = np.load(path)
    names = list(st["names"])
    get = lambda vs, k: np.array([st[k][names.index(v)] for v in vs], dtype=np.float32)[:, None, None]
    return get(IN_VARS, "mean"), get(IN_VARS, "std"), get(OUT_VARS, "mean"), get(OUT_VARS, "std")


class Pairs24h(Dataset):
    def __init__(self, nc_glob, period, in_stats, out_stats):
        ds = xr.open_mfdataset(nc_glob, combine="by_coords").sel(time=slice(*period))
        self.x = ds[IN_VARS].to_array("v").transpose("time", "v", "lat", "lon").isel(lat=slice(0, 180))
        self.y = ds[OUT_VARS].to_array("v").transpose("time", "v", "lat", "lon").isel(lat=slice(0, 180))
        self.lat = ds.lat.values[:180]
        (self.xm, self.xs), (self.ym, self.ys) = in_stats, out_stats

    def __len__(self):
        return self.x.sizes["time"] - 4

    def __getitem__(self, i):
        x = (self.x.isel(time=i).values - self.xm) / self.xs
        y = (self.y.isel(time=i + 4).values - self.ym) / self.ys
        return torch.from_numpy(x.astype(np.float32)), torch.from_numpy(y.astype(np.float32))


class ResBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x):
        h = F.relu(self.b1(self.c1(x)))
        h = self.b2(self.c2(h))
        return F.relu(h + self.skip(x))


class ResUNet(nn.Module):
    def __init__(self, cin, cout, base=64):
        super().__init__()
        self.d1, self.d2, self.d3 = ResBlock(cin, base), ResBlock(base, 2 * base), ResBlock(2 * base, 4 * base)
        self.mid = ResBlock(4 * base, 4 * base)
        self.u3, self.u2, self.u1 = ResBlock(8 * base, 2 * base), ResBlock(4 * base, base), ResBlock(2 * base, base)
        self.out = nn.Conv2d(base, cout, 1)

    def forward(self, x):
        a = self.d1(x)
        b = self.d2(F.max_pool2d(a, 2))
        c = self.d3(F.max_pool2d(b, 2))
        m = self.mid(F.max_pool2d(c, 2))
        u = self.u3(torch.cat([F.interpolate(m, size=c.shape[-2:], mode="bilinear"), c], 1))
        u = self.u2(torch.cat([F.interpolate(u, size=b.shape[-2:], mode="bilinear"), b], 1))
        u = self.u1(torch.cat([F.interpolate(u, size=a.shape[-2:], mode="bilinear"), a], 1))
        return self.out(u)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nc_glob", default="/shared/wx/era5_1p0/era5_*.nc")
    ap.add_argument("--run_dir", default="/shared/wx/runs/resunet_24h")
    ap.add_argument("--batch_size", type=int, default=8, help="per GPU; BatchNorm is synchronised")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # first run: rank 0 spends a while computing the statistics while the others wait in a barrier
    dist.init_process_group(backend="nccl", timeout=datetime.timedelta(minutes=90))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    if rank == 0:
        os.makedirs(args.run_dir, exist_ok=True)
        wandb.init(project="resunet-24h", dir=args.run_dir, config=vars(args))
    dist.barrier()

    xm, xs, ym, ys = load_or_build_stats(args.run_dir, args.nc_glob, rank)
    train_ds = Pairs24h(args.nc_glob, TRAIN, (xm, xs), (ym, ys))
    val_ds = Pairs24h(args.nc_glob, VALID, (xm, xs), (ym, ys))
    lat = train_ds.lat
    val_ds = Subset(val_ds, list(range(rank, len(val_ds), world)))
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=16, num_workers=4, pin_memory=True)

    model = ResUNet(len(IN_VARS), len(OUT_VARS))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(train_dl))
    start = 0
    ckpt_path = os.path.join(args.run_dir, "last.pt")
    if args.resume and os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start = ck["epoch"] + 1

    w = torch.as_tensor(np.cos(np.deg2rad(lat)), dtype=torch.float32, device=device)
    w = (w / w.mean()).view(1, 1, -1, 1)
    ys_t = torch.as_tensor(ys, device=device).view(1, -1, 1, 1)

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, skipped = time.time(), 0
        for it, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            bad = torch.logical_not(torch.isfinite(x).all() & torch.isfinite(y).all()).float()
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            if bad.item() > 0:  # every rank sees the same flag, so all of them skip this step
                skipped += 1
                continue
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(x)
            loss = (w * (pred.float() - y) ** 2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and it % 100 == 0:
                wandb.log({"train/loss": loss.item(), "train/lr": sched.get_last_lr()[0],
                           "epoch": epoch + it / len(train_dl)})

        model.eval()
        acc = torch.zeros(len(OUT_VARS) + 1, device=device, dtype=torch.float64)
        with torch.no_grad():
            for x, y in val_dl:
                x, y = x.to(device), y.to(device)
                keep = torch.isfinite(x).flatten(1).all(1) & torch.isfinite(y).flatten(1).all(1)
                if not keep.any():
                    continue
                pred = model.module(x[keep]).float()
                acc[:-1] += (w * ((pred - y[keep]) * ys_t) ** 2).mean((-2, -1)).sum(0).double()
                acc[-1] += keep.sum()
        dist.all_reduce(acc)
        rmse = (acc[:-1] / acc[-1]).sqrt().tolist()
        if rank == 0:
            wandb.log({f"val/rmse_{v}": r for v, r in zip(OUT_VARS, rmse)} | {"train/skipped": skipped,
                                                                             "epoch": epoch + 1})
            print(f"epoch {epoch} ({time.time() - t0:.0f}s) skipped {skipped} val " +
                  " ".join(f"{v}={r:.3f}" for v, r in zip(OUT_VARS, rmse)), flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
