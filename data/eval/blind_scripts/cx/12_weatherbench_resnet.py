"""WeatherBench-style deep ResNet (Rasp & Thuerey 2021) on 1.40625 deg ERA5,
direct 3-day / 5-day prediction of z500, t850, t2m, tp from a 3-state history.

Global batch is 16 (8 GPUs x 2); predictions are evaluated with latitude-weighted
RMSE against the 2017-2018 test period.
"""
import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import xarray as xr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

IN_VARS = ["z", "t", "u", "v", "q"]       # on 7 levels each
IN_LEVELS = [50, 250, 500, 600, 700, 850, 925]
SFC_VARS = ["t2m", "tp", "tisr"]
CONST = ["lsm", "orography", "lat2d"]
OUT = [("z", 500), ("t", 850), ("t2m", None), ("tp", None)]


class WBDataset(Dataset):
    def __init__(self, zarr_path, years, stats, lead_steps, history=(-12, -6, 0), dt_hours=1):
        ds = xr.open_zarr(zarr_path)
        ds = ds.sel(time=ds.time.dt.year.isin(list(years)))
        lev = ds[IN_VARS].sel(level=IN_LEVELS).to_array("var").stack(ch=("var", "level")).transpose("time", "ch", "lat", "lon")
        sfc = ds[SFC_VARS].to_array("var").rename(var="ch").transpose("time", "ch", "lat", "lon")
        self.lev, self.sfc = lev, sfc
        self.const = np.stack([ds[c].values for c in CONST]).astype(np.float32)
        self.const = (self.const - self.const.mean(axis=(1, 2), keepdims=True)) / self.const.std(axis=(1, 2), keepdims=True)
        self.mean = np.concatenate([stats["lev_mean"], stats["sfc_mean"]]).astype(np.float32)[:, None, None]
        self.std = np.concatenate([stats["lev_std"], stats["sfc_std"]]).astype(np.float32)[:, None, None]
        self.out_idx = [IN_VARS.index(v) * len(IN_LEVELS) + IN_LEVELS.index(l) if l else
                        len(IN_VARS) * len(IN_LEVELS) + SFC_VARS.index(v) for v, l in OUT]
        self.history = [h // dt_hours for h in history]
        self.lead = lead_steps
        self.first = -min(self.history)

    def __len__(self):
        return self.lev.sizes["time"] - self.first - self.lead

    def _state(self, t):
        s = np.concatenate([self.lev.isel(time=t).values, self.sfc.isel(time=t).values]).astype(np.float32)
        return (s - self.mean) / self.std

    def __getitem__(self, i):
        t = i + self.first
        x = np.concatenate([self._state(t + h) for h in self.history] + [self.const])
        y = self._state(t + self.lead)[self.out_idx]
        return torch.from_numpy(x), torch.from_numpy(y)


class PeriodicConv2d(nn.Module):
    def __init__(self, cin, cout, k):
        super().__init__()
        self.pad = (k - 1) // 2
        self.conv = nn.Conv2d(cin, cout, k)

    def forward(self, x):
        x = F.pad(x, (self.pad, self.pad, 0, 0), mode="circular")
        x = F.pad(x, (0, 0, self.pad, self.pad), mode="constant")
        return self.conv(x)


class ResBlock(nn.Module):
    def __init__(self, ch, dropout):
        super().__init__()
        self.c1 = PeriodicConv2d(ch, ch, 3)
        self.b1 = nn.BatchNorm2d(ch)
        self.c2 = PeriodicConv2d(ch, ch, 3)
        self.b2 = nn.BatchNorm2d(ch)
        self.drop = nn.Dropout2d(dropout)

    def forward(self, x):
        h = self.drop(self.b1(F.leaky_relu(self.c1(x))))
        h = self.drop(self.b2(F.leaky_relu(self.c2(h))))
        return x + h


class WBResNet(nn.Module):
    def __init__(self, cin, cout, hidden=128, n_blocks=19, dropout=0.1):
        super().__init__()
        self.stem = nn.Sequential(PeriodicConv2d(cin, hidden, 7), nn.LeakyReLU(), nn.BatchNorm2d(hidden))
        self.blocks = nn.Sequential(*[ResBlock(hidden, dropout) for _ in range(n_blocks)])
        self.head = PeriodicConv2d(hidden, cout, 3)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


def weighted_rmse_sums(pred, y, w):
    return (w * (pred - y) ** 2).mean(dim=(-2, -1)).sum(0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--zarr", default="/wx/data/weatherbench/1.40625deg_1h.zarr")
    ap.add_argument("--stats", default="/wx/data/weatherbench/stats_1979_2015_1.40625.npz")
    ap.add_argument("--lead_hours", type=int, default=72)
    ap.add_argument("--batch_size", type=int, default=2, help="per GPU")
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--patience", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("/wx/runs/wb_resnet"))
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    stats = dict(np.load(args.stats))
    train_ds = WBDataset(args.zarr, range(1979, 2016), stats, args.lead_hours)
    valid_ds = WBDataset(args.zarr, [2016], stats, args.lead_hours)
    test_ds = WBDataset(args.zarr, [2017, 2018], stats, args.lead_hours)
    valid_ds = torch.utils.data.Subset(valid_ds, list(range(rank, len(valid_ds), 6 * world)))
    test_ds = torch.utils.data.Subset(test_ds, list(range(rank, len(test_ds), 12 * world)))
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=10,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    valid_dl = DataLoader(valid_ds, batch_size=8, num_workers=4)
    test_dl = DataLoader(test_ds, batch_size=8, num_workers=4)

    cin = 3 * (len(IN_VARS) * len(IN_LEVELS) + len(SFC_VARS)) + len(CONST)
    model = WBResNet(cin, len(OUT)).to(dev)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.2, patience=2)

    lat = xr.open_zarr(args.zarr).lat.values
    w = torch.as_tensor(np.cos(np.deg2rad(lat)) / np.cos(np.deg2rad(lat)).mean(), dtype=torch.float32, device=dev)
    w = w.view(1, 1, -1, 1)

    def run_eval(loader):
        model.eval()
        s = torch.zeros(len(OUT) + 1, device=dev, dtype=torch.float64)
        with torch.no_grad():
            for x, y in loader:
                x, y = x.to(dev), y.to(dev)
                s[:-1] += weighted_rmse_sums(model.module(x), y, w).double()
                s[-1] += x.shape[0]
        dist.all_reduce(s)
        return torch.sqrt(s[:-1] / s[-1])

    best, bad_epochs = float("inf"), 0
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_dl):
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            loss = (w * (model(x) - y) ** 2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and i % 500 == 0:
                print(f"ep {epoch} {i}/{len(train_dl)} mse {loss.item():.4f}", flush=True)

        val_rmse = run_eval(valid_dl)
        val_score = val_rmse.mean().item()
        plateau.step(val_score)
        if val_score < best:
            best, bad_epochs = val_score, 0
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "val": val_score},
                           args.out / "best.pt")
        else:
            bad_epochs += 1
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s) val {val_rmse.tolist()} best {best:.4f}", flush=True)
        if bad_epochs >= args.patience:
            break

    dist.barrier()
    ckpt = torch.load(args.out / "best.pt", map_location=dev)
    model.module.load_state_dict(ckpt["model"])
    test_rmse = run_eval(test_dl)
    if rank == 0:
        names = [f"{v}{l or ''}" for v, l in OUT]
        res = {n: float(r * stats["std_out"][k]) for k, (n, r) in enumerate(zip(names, test_rmse.tolist()))}
        print("test RMSE (physical units):", res, flush=True)
        with open(args.out / "test_metrics.json", "w") as f:
            json.dump(res, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
