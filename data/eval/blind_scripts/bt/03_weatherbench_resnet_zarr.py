"""WeatherBench-style residual CNN emulator (5.625 deg) trained on an ERA5 zarr store.

Predicts the state 6 h ahead; validation rolls the model out to 72 h and reports
latitude-weighted RMSE for z500 / t850.

    torchrun --nnodes=2 --nproc_per_node=4 --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29400 \
        03_weatherbench_resnet_zarr.py --zarr /gpfs/shared/wb/era5_5.625deg.zarr \
        --cache-dir /gpfs/shared/wb/cache --out /gpfs/shared/wb/runs/resnet_6h
"""
import argparse
import json
import os
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

VARS = ["geopotential_500", "temperature_850", "2m_temperature",
        "10m_u_component_of_wind", "10m_v_component_of_wind", "total_column_water_vapour"]
CONST = ["land_sea_mask", "orography"]


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--zarr", required=True)
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--train", default="1979-01-01:2015-12-31")
    ap.add_argument("--val", default="2016-01-01:2016-12-31")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=19)
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--warmup-epochs", type=int, default=2)
    ap.add_argument("--rollout", type=int, default=12, help="6h steps in validation rollout")
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


def tslice(s):
    a, b = s.split(":")
    return slice(a, b)


def normalization_stats(store, train_slice, cache_dir):
    mean_f = os.path.join(cache_dir, "mean.npy")
    std_f = os.path.join(cache_dir, "std.npy")
    if os.path.exists(mean_f) and os.path.exists(std_f):
        return np.load(mean_f), np.load(std_f)
    os.makedirs(cache_dir, exist_ok=True)
    ds = xr.open_zarr(store).sel(time=train_slice)
    mean, std = [], []
    for v in VARS + CONST:
        da = ds[v]
        mean.append(float(da.mean().compute()))
        std.append(float(da.std().compute()))
    mean, std = np.asarray(mean, np.float32), np.asarray(std, np.float32)
    np.save(mean_f, mean)
    np.save(std_f, std)
    return mean, std


class ZarrPairs(Dataset):
    def __init__(self, store, time_slice, mean, std, n_ahead=1):
        ds = xr.open_zarr(store)
        self.ds = ds.sel(time=time_slice)
        self.const = ds[CONST].to_array().values.astype(np.float32)  # (2, lat, lon)
        nv = len(VARS)
        self.mean, self.std = mean[:nv, None, None], std[:nv, None, None]
        self.const = (self.const - mean[nv:, None, None]) / std[nv:, None, None]
        self.n_ahead = n_ahead
        self.n = self.ds.sizes["time"] - n_ahead

    def __len__(self):
        return self.n

    def _state(self, t0, t1):
        arr = self.ds[VARS].isel(time=slice(t0, t1)).to_array().values  # (var, time, lat, lon)
        arr = arr.transpose(1, 0, 2, 3).astype(np.float32)
        return (arr - self.mean) / self.std

    def __getitem__(self, i):
        states = self._state(i, i + 1 + self.n_ahead)
        x = np.concatenate([states[0], self.const], axis=0)
        y = states[1:] if self.n_ahead > 1 else states[1]
        return torch.from_numpy(x), torch.from_numpy(np.ascontiguousarray(y))


class PeriodicConv(nn.Module):
    """3x3 conv, circular in longitude, zero-padded at the poles."""

    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3)

    def forward(self, x):
        x = F.pad(x, (1, 1, 0, 0), mode="circular")
        x = F.pad(x, (0, 0, 1, 1))
        return self.conv(x)


class ResBlock(nn.Module):
    def __init__(self, ch, dropout=0.1):
        super().__init__()
        self.c1, self.c2 = PeriodicConv(ch, ch), PeriodicConv(ch, ch)
        self.n1, self.n2 = nn.GroupNorm(8, ch), nn.GroupNorm(8, ch)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        h = self.c1(F.leaky_relu(self.n1(x)))
        h = self.c2(self.drop(F.leaky_relu(self.n2(h))))
        return x + h


class ResNetEmulator(nn.Module):
    def __init__(self, n_vars, n_const, hidden, n_blocks):
        super().__init__()
        self.stem = PeriodicConv(n_vars + n_const, hidden)
        self.blocks = nn.Sequential(*[ResBlock(hidden) for _ in range(n_blocks)])
        self.head = PeriodicConv(hidden, n_vars)

    def forward(self, x):
        n_vars = self.head.conv.out_channels
        return x[:, :n_vars] + self.head(self.blocks(self.stem(x)))


def lat_weight(nlat, device):
    lat = torch.linspace(-87.1875, 87.1875, nlat, device=device)
    w = torch.cos(torch.deg2rad(lat))
    return (w / w.mean()).view(1, 1, nlat, 1)


@torch.no_grad()
def rollout_rmse(net, loader, const_ch, w, std, device):
    net.eval()
    sse, n = None, torch.zeros((), device=device)
    for x, ys in loader:
        x, ys = x.to(device), ys.to(device)
        const = x[:, -const_ch:]
        state = x
        errs = []
        for k in range(ys.shape[1]):
            pred = net(state)
            errs.append((w * (pred - ys[:, k]) ** 2).mean(dim=(-1, -2)))  # (B, V)
            state = torch.cat([pred, const], dim=1)
        e = torch.stack(errs, dim=1).sum(0)  # (steps, V)
        sse = e if sse is None else sse + e
        n += x.shape[0]
    dist.all_reduce(sse)
    dist.all_reduce(n)
    return torch.sqrt(sse / n) * std.view(1, -1)


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    mean, std = normalization_stats(args.zarr, tslice(args.train), args.cache_dir)
    train_ds = ZarrPairs(args.zarr, tslice(args.train), mean, std)
    val_ds = ZarrPairs(args.zarr, tslice(args.val), mean, std, n_ahead=args.rollout)
    # validation starts every 48 h, sharded without padding
    val_ds_idx = list(range(0, len(val_ds), 8))[rank::world]
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, args.bs, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, val_ds_idx), batch_size=8, num_workers=4)

    model = ResNetEmulator(len(VARS), len(CONST), args.hidden, args.blocks).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
    steps_per_epoch = len(train_dl)
    warm = args.warmup_epochs * steps_per_epoch
    total = args.epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + np.cos(np.pi * (s - warm) / (total - warm))))
    w = lat_weight(train_ds.ds.sizes["lat"], device)
    std_t = torch.from_numpy(std[: len(VARS)]).to(device)

    os.makedirs(args.out, exist_ok=True)
    ckpt_file = os.path.join(args.out, "latest.pt")
    first_epoch = 0
    if os.path.isfile(ckpt_file):
        state = torch.load(ckpt_file, map_location="cpu")
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        first_epoch = state["epoch"] + 1

    for epoch in range(first_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        acc = torch.zeros(2, device=device)
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = (w * (model(x) - y) ** 2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(acc)
        rmse = rollout_rmse(model.module, val_dl, len(CONST), w, std_t, device)
        if rank == 0:
            z500_72h = rmse[-1, VARS.index("geopotential_500")].item()
            t850_72h = rmse[-1, VARS.index("temperature_850")].item()
            print(json.dumps({"epoch": epoch, "train_mse": (acc[0] / acc[1]).item(), "z500_72h": z500_72h,
                              "t850_72h": t850_72h, "time_s": round(time.time() - tic)}), flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "mean": mean, "std": std},
                       ckpt_file + ".part")
            os.replace(ckpt_file + ".part", ckpt_file)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
