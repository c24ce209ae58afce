"""Direct 3-day ResNet forecast (Rasp & Thuerey style) on 5.625 deg WeatherBench data.

Single node, processes started with torch.multiprocessing:
    python 10_resnet_spawn_syncbn.py --gpus 4 --data /data/weatherbench/5.625deg
"""
import argparse
import os
import socket
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import xarray as xr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

INPUT_VARS = [("geopotential", 500), ("temperature", 850), ("2m_temperature", None),
              ("specific_humidity", 850), ("u_component_of_wind", 850), ("v_component_of_wind", 850),
              ("toa_incident_solar_radiation", None)]
TARGETS = [0, 1, 2]  # z500, t850, t2m


def open_vars(root, start, end):
    arrs = []
    for name, level in INPUT_VARS:
        da = xr.open_mfdataset(f"{root}/{name}/*.nc", combine="by_coords")[_short(name)]
        da = da.sel(time=slice(start, end))
        da = da.sel(time=da.time.dt.hour.isin([0, 6, 12, 18]))  # 6-hourly
        if level is not None:
            da = da.sel(level=level)
        arrs.append(da)
    stacked = xr.concat(arrs, dim="channel").transpose("time", "channel", "lat", "lon")
    return stacked.values.astype(np.float32), stacked.lat.values


def _short(name):
    return {"geopotential": "z", "temperature": "t", "2m_temperature": "t2m", "specific_humidity": "q",
            "u_component_of_wind": "u", "v_component_of_wind": "v", "toa_incident_solar_radiation": "tisr"}[name]


class LeadDataset(Dataset):
    """Inputs at t-12h, t-6h, t; target at t + lead. Indices are 6 h steps."""

    def __init__(self, data, mean, std, lead_h, history=(-2, -1, 0)):
        self.data = (data - mean) / std
        self.lead, self.hist = lead_h // 6, history
        self.first = -min(history)

    def __len__(self):
        return self.data.shape[0] - self.first - self.lead

    def __getitem__(self, i):
        t = i + self.first
        x = np.concatenate([self.data[t + h] for h in self.hist], axis=0)
        y = self.data[t + self.lead, TARGETS]
        return torch.from_numpy(x), torch.from_numpy(y)


class ResBlock(nn.Module):
    def __init__(self, ch, dropout):
        super().__init__()
        self.c1 = nn.Conv2d(ch, ch, 3, padding=(1, 0))
        self.b1 = nn.BatchNorm2d(ch)
        self.c2 = nn.Conv2d(ch, ch, 3, padding=(1, 0))
        self.b2 = nn.BatchNorm2d(ch)
        self.drop = nn.Dropout2d(dropout)

    def forward(self, x):
        h = self.drop(F.leaky_relu(self.b1(self.c1(F.pad(x, (1, 1, 0, 0), mode="circular")))))
        h = self.drop(F.leaky_relu(self.b2(self.c2(F.pad(h, (1, 1, 0, 0), mode="circular")))))
        return x + h


class WBResNet(nn.Module):
    def __init__(self, cin, cout, width=128, blocks=19, dropout=0.1):
        super().__init__()
        self.inp = nn.Conv2d(cin, width, 7, padding=(3, 0))
        self.blocks = nn.Sequential(*[ResBlock(width, dropout) for _ in range(blocks)])
        self.out = nn.Conv2d(width, cout, 3, padding=(1, 0))

    def forward(self, x):
        x = self.inp(F.pad(x, (3, 3, 0, 0), mode="circular"))
        x = self.blocks(x)
        return self.out(F.pad(x, (1, 1, 0, 0), mode="circular"))


def compute_stats(root, cache):
    data, _ = open_vars(root, "1979", "2015")
    mean = data.mean(axis=(0, 2, 3), keepdims=True)[0]
    std = data.std(axis=(0, 2, 3), keepdims=True)[0]
    np.savez(cache + ".tmp.npz", mean=mean, std=std)
    os.replace(cache + ".tmp.npz", cache)


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    st = np.load(os.path.join(args.data, "norm_1979_2015.npz"))
    mean, std = st["mean"], st["std"]

    train_np, lat = open_vars(args.data, "1979", "2015")
    val_np, _ = open_vars(args.data, "2016", "2016")
    train_ds = LeadDataset(train_np, mean, std, args.lead_hours)
    val_all = LeadDataset(val_np, mean, std, args.lead_hours)
    val_ds = Subset(val_all, list(range(rank, len(val_all), world_size)))

    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size, num_workers=2, pin_memory=True)

    cin = len(INPUT_VARS) * 3
    net = WBResNet(cin, len(TARGETS), dropout=args.dropout)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[rank])
    # per-GPU batch is fixed, so the global batch is batch_size * world_size
    lr = args.lr * world_size
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.2, patience=2)

    w = torch.cos(torch.deg2rad(torch.tensor(lat, dtype=torch.float32, device=device)))
    w = (w / w.mean()).view(1, 1, -1, 1)
    std_y = torch.from_numpy(std[TARGETS]).to(device).unsqueeze(0)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best, bad_epochs = float("inf"), 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = ((model(x) - y) ** 2 * w).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        net.eval()
        acc = torch.zeros(len(TARGETS) + 2, dtype=torch.float64, device=device)
        with torch.no_grad():
            for x, y in val_dl:
                x, y = x.to(device), y.to(device)
                pred = net(x)
                acc[0] += (((pred - y) ** 2) * w).mean().double() * x.shape[0]
                acc[1:-1] += ((((pred - y) * std_y) ** 2) * w).mean(dim=(-2, -1)).sqrt().sum(0).double()
                acc[-1] += x.shape[0]
        dist.all_reduce(acc)
        val_loss = (acc[0] / acc[-1]).item()
        rmse = (acc[1:-1] / acc[-1]).tolist()
        plateau.step(val_loss)

        if rank == 0:
            print(f"epoch {epoch} {time.time() - t0:.0f}s val_loss {val_loss:.4f} "
                  f"z500 {rmse[0]:.1f} t850 {rmse[1]:.2f} t2m {rmse[2]:.2f} lr {opt.param_groups[0]['lr']:.1e}",
                  flush=True)
            if val_loss < best:
                torch.save({"model": net.state_dict(), "epoch": epoch, "val_loss": val_loss,
                            "mean": mean.tolist(), "std": std.tolist()},
                           os.path.join(args.out, "best.pt"))
        if val_loss < best:
            best, bad_epochs = val_loss, 0
        else:
            bad_epochs += 1
        if bad_epochs >= args.patience:
            break  # val_loss is all-reduced, so every rank stops at the same epoch

    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/wb_resnet_3d")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--lead-hours", type=int, default=72)
    ap.add_argument("--batch-size", type=int, default=16, help="per GPU")
    ap.add_argument("--lr", type=float, default=5e-5, help="single-GPU learning rate")
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--patience", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    cache = os.path.join(args.data, "norm_1979_2015.npz")
    if not os.path.exists(cache):
        compute_stats(args.data, cache)  # once, in the parent, before any worker starts

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)
