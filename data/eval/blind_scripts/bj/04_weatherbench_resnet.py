"""WeatherBench 5.625deg baseline: ResNet forecasting z500/t850/t2m at +3 days.

Run from the sbatch script:
    srun --ntasks-per-node=1 torchrun --nnodes 2 --nproc_per_node 4 \
         --rdzv_backend c10d --rdzv_endpoint ${MASTER_ADDR}:29400 04_weatherbench_resnet.py
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
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

VARS = [("geopotential", 500), ("temperature", 850), ("2m_temperature", None),
        ("u_component_of_wind", 850), ("v_component_of_wind", 850), ("specific_humidity", 850),
        ("toa_incident_solar_radiation", None)]
TARGETS = [0, 1, 2]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", default="/gpfs/weather/weatherbench/5.625deg")
    p.add_argument("--stats-file", default="/gpfs/weather/weatherbench/5.625deg/norm_stats_1979-2015.npz")
    p.add_argument("--train-years", default="1979-2015")
    p.add_argument("--val-years", default="2016-2016")
    p.add_argument("--lead-hours", type=int, default=72)
    p.add_argument("--history", type=int, default=3, help="input time steps (6 h apart)")
    p.add_argument("--channels", type=int, default=128)
    p.add_argument("--blocks", type=int, default=19)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--run-dir", default="/gpfs/weather/runs/wb_resnet")
    return p.parse_args()


def years(spec):
    a, b = spec.split("-")
    return [str(y) for y in range(int(a), int(b) + 1)]


def open_fields(root, yrs):
    arrays = []
    for name, level in VARS:
        ds = xr.open_mfdataset(f"{root}/{name}/*.nc", combine="by_coords", parallel=False)
        da = ds[list(ds.data_vars)[0]].sel(time=slice(yrs[0], yrs[-1]))
        if level is not None:
            da = da.sel(level=level)
        arrays.append(da)
    fields = xr.concat(arrays, dim="var").transpose("time", "var", "lat", "lon")
    return fields.isel(time=slice(None, None, 6))  # hourly -> 6-hourly


def get_norm_stats(fields, path):
    if os.path.exists(path):
        s = np.load(path)
        return s["mean"], s["std"]
    # one pass over the training period, per variable
    mean = fields.mean(("time", "lat", "lon")).compute().values
    std = fields.std(("time", "lat", "lon")).compute().values
    np.savez(path, mean=mean, std=std)
    return mean, std


class WBDataset(Dataset):
    def __init__(self, fields, mean, std, lead_hours, history):
        self.data = fields.values.astype(np.float32)  # ~3 GB at 6-hourly resolution
        self.data = (self.data - mean[None, :, None, None]) / std[None, :, None, None]
        self.lead = lead_hours // 6
        self.history = history
        self.t0 = history - 1
        self.n = self.data.shape[0] - self.lead - self.t0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        t = i + self.t0
        x = self.data[t - self.history + 1: t + 1].reshape(-1, *self.data.shape[2:])
        y = self.data[t + self.lead, TARGETS]
        return torch.from_numpy(x), torch.from_numpy(y)


class PeriodicConv2d(nn.Conv2d):
    """Circular padding in longitude, zero padding at the poles."""

    def forward(self, x):
        p = self.kernel_size[0] // 2
        x = F.pad(x, (p, p, 0, 0), mode="circular")
        x = F.pad(x, (0, 0, p, p))
        return F.conv2d(x, self.weight, self.bias, self.stride)


class ResBlock(nn.Module):
    def __init__(self, ch, dropout):
        super().__init__()
        self.c1 = PeriodicConv2d(ch, ch, 3)
        self.c2 = PeriodicConv2d(ch, ch, 3)
        self.n1 = nn.GroupNorm(8, ch)
        self.n2 = nn.GroupNorm(8, ch)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        h = self.drop(F.leaky_relu(self.n1(self.c1(x))))
        h = self.n2(self.c2(h))
        return F.leaky_relu(x + h)


class ResNet(nn.Module):
    def __init__(self, cin, cout, ch, n_blocks, dropout):
        super().__init__()
        self.inp = PeriodicConv2d(cin, ch, 7)
        self.blocks = nn.Sequential(*[ResBlock(ch, dropout) for _ in range(n_blocks)])
        self.out = PeriodicConv2d(ch, cout, 3)

    def forward(self, x):
        return self.out(self.blocks(F.leaky_relu(self.inp(x))))


def lat_weighted_rmse_sums(pred, y, w):
    # returns per-variable sum over samples of the spatially weighted MSE
    return (w * (pred - y) ** 2).mean(dim=(-2, -1)).sum(0)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_fields = open_fields(args.data_root, years(args.train_years))
    val_fields = open_fields(args.data_root, years(args.val_years))
    mean, std = get_norm_stats(train_fields, args.stats_file)
    train_ds = WBDataset(train_fields, mean, std, args.lead_hours, args.history)
    val_ds = WBDataset(val_fields, mean, std, args.lead_hours, args.history)

    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_idx = list(range(rank, len(val_ds), world))
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, val_idx), batch_size=64, num_workers=2)

    cin = len(VARS) * args.history
    model = ResNet(cin, len(TARGETS), args.channels, args.blocks, args.dropout).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=2)

    lat = torch.as_tensor(val_fields.lat.values, dtype=torch.float32, device=device)
    w = torch.cos(torch.deg2rad(lat))
    w = (w / w.mean()).view(1, 1, -1, 1)
    std_t = torch.as_tensor(std[TARGETS], dtype=torch.float32, device=device)

    if rank == 0:
        os.makedirs(args.run_dir, exist_ok=True)
    best = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tl = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = (w * (model(x) - y) ** 2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tl += torch.stack([loss.detach(), torch.ones((), device=device)])

        model.eval()
        vs = torch.zeros(len(TARGETS) + 1, device=device)
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device), y.to(device)
                vs[:-1] += lat_weighted_rmse_sums(model.module(x), y, w)
                vs[-1] += x.shape[0]
        dist.all_reduce(tl)
        dist.all_reduce(vs)
        rmse = torch.sqrt(vs[:-1] / vs[-1]) * std_t
        val_loss = (vs[:-1] / vs[-1]).mean().item()
        sched.step(val_loss)

        if rank == 0:
            print(f"[{epoch:02d}] train {tl[0] / tl[1]:.4f}  val {val_loss:.4f}  "
                  f"RMSE z500 {rmse[0]:.1f} m2/s2  t850 {rmse[1]:.2f} K  t2m {rmse[2]:.2f} K  "
                  f"({time.time() - t0:.0f}s)", flush=True)
            ckpt = {"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch,
                    "mean": mean, "std": std}
            torch.save(ckpt, os.path.join(args.run_dir, "last.pt"))
            if val_loss < best:
                best = val_loss
                torch.save(ckpt, os.path.join(args.run_dir, "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
