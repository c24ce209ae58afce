"""U-Net forecaster on 2.8125 deg ERA5 (64 x 128) with 3-step rollout training.

Validation: latitude-weighted RMSE and anomaly correlation coefficient (ACC)
against a 1990-2017 day-of-year/hour climatology, over the full 2018 period.
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import xarray as xr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

VARS = ["z500", "t850", "t2m", "u10", "v10", "tp6h", "q700", "z1000"]
DEVICE = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


# ------------------------------------------------------------------ metrics
class Climatology:
    """Day-of-year x hour climatology, looked up per initialisation time."""

    def __init__(self, path, variables, mean, std):
        clim = xr.open_dataset(path)[variables].to_array("var").transpose("dayofyear", "hour", "var", "lat", "lon")
        clim = (clim.values - mean[None, None, :, None, None]) / std[None, None, :, None, None]
        self.hours = list(xr.open_dataset(path).hour.values)
        self.table = torch.as_tensor(clim, dtype=torch.float32, device=DEVICE)

    def lookup(self, times):
        t = pd.to_datetime(times)
        doy = torch.as_tensor(np.minimum(t.dayofyear.values, 366) - 1, device=DEVICE)
        hr = torch.as_tensor([self.hours.index(h) for h in t.hour], device=DEVICE)
        return self.table[doy, hr]


def lat_weights(lat, device):
    w = torch.cos(torch.deg2rad(torch.as_tensor(lat, dtype=torch.float32, device=device)))
    return (w / w.mean()).view(1, 1, -1, 1)


def acc_and_mse(pred, truth, clim, w):
    pa, ta = pred - clim, truth - clim
    num = (w * pa * ta).sum(dim=(-2, -1))
    den = torch.sqrt((w * pa ** 2).sum(dim=(-2, -1)) * (w * ta ** 2).sum(dim=(-2, -1)))
    mse = (w * (pred - truth) ** 2).mean(dim=(-2, -1))
    return num / den, mse


# ------------------------------------------------------------------ data
class Windows(Dataset):
    def __init__(self, path, start, end, mean, std, steps):
        ds = xr.open_zarr(path).sel(time=slice(start, end))
        self.da = ds[VARS].to_array("var").transpose("time", "var", "lat", "lon")
        self.times = ds.time.values
        self.lat = ds.lat.values
        self.mean, self.std = mean[:, None, None], std[:, None, None]
        self.steps = steps

    def __len__(self):
        return len(self.times) - self.steps

    def __getitem__(self, i):
        w = (self.da.isel(time=slice(i, i + self.steps + 1)).values - self.mean) / self.std
        valid_times = self.times[i + 1: i + self.steps + 1].astype("datetime64[ns]").astype(np.int64)
        return torch.from_numpy(w.astype(np.float32)), torch.from_numpy(valid_times)


# ------------------------------------------------------------------ model
class PeriodicConv(nn.Module):
    """3x3 conv with circular padding in longitude and zero padding at the poles."""

    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=0)

    def forward(self, x):
        x = F.pad(x, (1, 1, 0, 0), mode="circular")
        x = F.pad(x, (0, 0, 1, 1))
        return self.conv(x)


class DoubleConv(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.net = nn.Sequential(PeriodicConv(cin, cout), nn.GroupNorm(8, cout), nn.SiLU(),
                                 PeriodicConv(cout, cout), nn.GroupNorm(8, cout), nn.SiLU())

    def forward(self, x):
        return self.net(x)


class UNet(nn.Module):
    def __init__(self, ch, base=64):
        super().__init__()
        self.e1 = DoubleConv(ch, base)
        self.e2 = DoubleConv(base, base * 2)
        self.e3 = DoubleConv(base * 2, base * 4)
        self.mid = DoubleConv(base * 4, base * 4)
        self.d3 = DoubleConv(base * 8, base * 2)
        self.d2 = DoubleConv(base * 4, base)
        self.d1 = DoubleConv(base * 2, base)
        self.out = nn.Conv2d(base, ch, 1)

    def forward(self, x):
        h1 = self.e1(x)
        h2 = self.e2(F.avg_pool2d(h1, 2))
        h3 = self.e3(F.avg_pool2d(h2, 2))
        m = self.mid(F.avg_pool2d(h3, 2))
        u = self.d3(torch.cat([F.interpolate(m, scale_factor=2), h3], 1))
        u = self.d2(torch.cat([F.interpolate(u, scale_factor=2), h2], 1))
        u = self.d1(torch.cat([F.interpolate(u, scale_factor=2), h1], 1))
        return x + self.out(u)


# ------------------------------------------------------------------ eval
@torch.no_grad()
def validate(net, loader, clim, w, device, steps):
    net.eval()
    tot = torch.zeros(3, steps, len(VARS), device=device, dtype=torch.float64)  # acc, mse, n
    for win, vtimes in loader:
        win = win.to(device, non_blocking=True)
        x = win[:, 0]
        for s in range(steps):
            x = net(x)
            c = clim.lookup(vtimes[:, s].numpy().astype("datetime64[ns]"))
            acc, mse = acc_and_mse(x, win[:, s + 1], c, w)
            tot[0, s] += acc.sum(0).double()
            tot[1, s] += mse.sum(0).double()
            tot[2, s] += x.shape[0]
    dist.all_reduce(tot)
    return tot[0] / tot[2], torch.sqrt(tot[1] / tot[2])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--zarr", default="/nfs/wx/era5_5.625/era5_2p8125_6h.zarr")
    ap.add_argument("--stats", default="/nfs/wx/era5_5.625/stats_1979_2015.npz")
    ap.add_argument("--clim", default="/nfs/wx/era5_5.625/clim_1990_2017_doy_hour.nc")
    ap.add_argument("--out", default="/nfs/wx/runs/unet_rollout")
    ap.add_argument("--train_steps", type=int, default=3)
    ap.add_argument("--eval_steps", type=int, default=20)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-4)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    st = np.load(args.stats)
    mean = np.array([st["mean"][list(st["names"]).index(v)] for v in VARS], dtype=np.float32)
    std = np.array([st["std"][list(st["names"]).index(v)] for v in VARS], dtype=np.float32)

    train_ds = Windows(args.zarr, "1979-01-01", "2015-12-31", mean, std, args.train_steps)
    valid_ds = Windows(args.zarr, "2018-01-01", "2018-12-31", mean, std, args.eval_steps)
    valid_ds = torch.utils.data.Subset(valid_ds, list(range(rank, len(valid_ds), world)))
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.bs, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)
    valid_dl = DataLoader(valid_ds, 8, shuffle=False, num_workers=4, pin_memory=True)

    clim = Climatology(args.clim, VARS, mean, std)
    w = lat_weights(train_ds.lat, device)

    net = DDP(UNet(len(VARS)).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    best = -1.0
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        net.train()
        t0 = time.time()
        for it, (win, _) in enumerate(train_dl):
            win = win.to(device, non_blocking=True)
            x = win[:, 0]
            loss = 0.0
            for s in range(args.train_steps):
                x = net(x)
                loss = loss + (w * (x - win[:, s + 1]) ** 2).mean()
            loss = loss / args.train_steps
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and it % 200 == 0:
                print(f"[{epoch}:{it}] loss={loss.item():.4f}", flush=True)
        sched.step()

        acc, rmse = validate(net.module, valid_dl, clim, w, device, args.eval_steps)
        z_acc_d5 = acc[19, VARS.index("z500")].item()
        if rank == 0:
            z_rmse_d5 = rmse[19, VARS.index("z500")].item() * std[VARS.index("z500")]
            print(f"epoch {epoch} {time.time() - t0:.0f}s  z500 d5: ACC {z_acc_d5:.3f} RMSE {z_rmse_d5:.1f}",
                  flush=True)
            state = {"model": net.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                     "epoch": epoch, "acc_z500_d5": z_acc_d5}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if z_acc_d5 > best:
                best = z_acc_d5
                torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
