"""ConvNeXt forecaster on 1.5 deg ERA5 (WeatherBench2 "era5_1.5deg" subset) with a 2-step rollout loss.

    torchrun --nproc_per_node=4 09_convnext_forecaster.py --data /data/wb2/era5_1.5deg_13lev.zarr
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
from torch.utils.tensorboard import SummaryWriter

PL_VARS = ["geopotential", "temperature", "u_component_of_wind", "v_component_of_wind", "specific_humidity"]
SFC_VARS = ["2m_temperature", "10m_u_component_of_wind", "10m_v_component_of_wind", "mean_sea_level_pressure"]
LEVELS = [50, 100, 150, 200, 250, 300, 400, 500, 600, 700, 850, 925, 1000]


def parse_args():
    parser = argparse.ArgumentParser(description="ConvNeXt ERA5 forecaster")
    parser.add_argument("--data", type=str, required=True)
    parser.add_argument("--stats", type=str, default="/data/wb2/era5_1.5deg_1979_2015_stats.npz")
    parser.add_argument("--save-dir", type=str, default="./ckpt_convnext")
    parser.add_argument("--epochs", type=int, default=25)
    parser.add_argument("--batch-size", type=int, default=8, help="per-GPU batch size")
    parser.add_argument("--lr", type=float, default=1e-3, help="lr at 4 GPUs x batch 8")
    parser.add_argument("--rollout", type=int, default=2)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


def open_years(path, start, end):
    ds = xr.open_zarr(path, chunks=None).sel(time=slice(start, end), level=LEVELS)
    ds = ds.sel(time=ds.time.dt.hour.isin([0, 6, 12, 18]))
    return ds[PL_VARS + SFC_VARS].transpose("time", "level", "latitude", "longitude")


class Windows(Dataset):
    """Reads (x_t, x_{t+1..t+R}) lazily from the zarr store."""

    def __init__(self, ds, mean, std, rollout):
        self.ds = ds
        self.n = ds.sizes["time"]
        self.mean, self.std = mean, std
        self.rollout = rollout

    def __len__(self):
        return self.n - self.rollout

    def _stack(self, sl):
        sub = self.ds.isel(time=sl)
        pl = np.concatenate([sub[v].values for v in PL_VARS], axis=1)     # (T, 5*13, lat, lon)
        sfc = np.stack([sub[v].values for v in SFC_VARS], axis=1)         # (T, 4, lat, lon)
        arr = np.concatenate([pl, sfc], axis=1).astype(np.float32)
        return (arr - self.mean) / self.std

    def __getitem__(self, i):
        arr = self._stack(slice(i, i + 1 + self.rollout))
        return torch.from_numpy(arr[0]), torch.from_numpy(arr[1:])


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dw = nn.Conv2d(dim, dim, 7, padding=(3, 0), groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.pw1 = nn.Linear(dim, 4 * dim)
        self.pw2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(1e-6 * torch.ones(dim))

    def forward(self, x):
        h = self.dw(F.pad(x, (3, 3, 0, 0), mode="circular")).permute(0, 2, 3, 1)
        h = self.pw2(F.gelu(self.pw1(self.norm(h))))
        return x + (self.gamma * h).permute(0, 3, 1, 2)


class Forecaster(nn.Module):
    def __init__(self, ch, width, depth):
        super().__init__()
        self.stem = nn.Conv2d(ch, width, 2, 2)
        self.blocks = nn.Sequential(*[ConvNeXtBlock(width) for _ in range(depth)])
        self.up = nn.ConvTranspose2d(width, width, 2, 2)
        self.out = nn.Conv2d(width + ch, ch, 3, padding=1)

    def forward(self, x):
        # 121 x 240 grid: leave the last pole row out so the grid halves cleanly
        core = x[:, :, :120]
        h = self.up(self.blocks(self.stem(core)))
        d = self.out(torch.cat([h, core], dim=1))
        return torch.cat([core + d, x[:, :, 120:]], dim=2)


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    torch.manual_seed(42)

    norm = np.load(args.stats)
    mean = norm["mean"].astype(np.float32)[:, None, None]
    std = norm["std"].astype(np.float32)[:, None, None]
    train_ds = open_years(args.data, "1979-01-01", "2015-12-31")
    lat = train_ds.latitude.values
    train_set = Windows(train_ds, mean, std, args.rollout)
    val_set = Windows(open_years(args.data, "2016-01-01", "2017-12-31"), mean, std, args.rollout)
    val_local = Subset(val_set, range(rank, len(val_set), world_size))

    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=8, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_local, batch_size=args.batch_size, num_workers=4, pin_memory=True)

    n_ch = mean.shape[0]
    model = Forecaster(n_ch, args.width, args.depth).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    lr = args.lr * (world_size * args.batch_size) / 32
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs * len(train_loader))

    w = torch.cos(torch.deg2rad(torch.tensor(lat, dtype=torch.float32))).clamp_min(0).to(device)
    w = (w / w.mean()).view(1, 1, 1, -1, 1)
    std_t = torch.from_numpy(std).to(device).unsqueeze(0)
    z500 = PL_VARS.index("geopotential") * len(LEVELS) + LEVELS.index(500)
    t850 = PL_VARS.index("temperature") * len(LEVELS) + LEVELS.index(850)

    writer = SummaryWriter(os.path.join(args.save_dir, "logs")) if rank == 0 else None
    best = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        start = time.time()
        for step, (x, ys) in enumerate(train_loader):
            x, ys = x.to(device, non_blocking=True), ys.to(device, non_blocking=True)
            preds = []
            with torch.autocast("cuda", dtype=torch.bfloat16):
                for _ in range(args.rollout):
                    x = model(x)
                    preds.append(x)
            loss = ((torch.stack(preds, 1).float() - ys) ** 2 * w).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if writer is not None and step % 50 == 0:
                writer.add_scalar("loss/train", loss.item(), epoch * len(train_loader) + step)

        model.eval()
        stats = torch.zeros(args.rollout, 3, dtype=torch.float64, device=device)
        with torch.no_grad():
            for x, ys in val_loader:
                x, ys = x.to(device), ys.to(device)
                for k in range(args.rollout):
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        x = model.module(x).float()
                    rmse = ((((x - ys[:, k]) * std_t) ** 2) * w[0]).mean(dim=(-2, -1)).sqrt()
                    stats[k, 0] += rmse[:, z500].sum()
                    stats[k, 1] += rmse[:, t850].sum()
                    stats[k, 2] += x.shape[0]
        dist.all_reduce(stats)
        z = (stats[:, 0] / stats[:, 2]).tolist()
        t = (stats[:, 1] / stats[:, 2]).tolist()

        if rank == 0:
            for k in range(args.rollout):
                writer.add_scalar(f"val/z500_{6 * (k + 1)}h", z[k], epoch)
                writer.add_scalar(f"val/t850_{6 * (k + 1)}h", t[k], epoch)
            print(f"[epoch {epoch}] {time.time() - start:.0f}s z500 {z} t850 {t}", flush=True)
            os.makedirs(args.save_dir, exist_ok=True)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch,
                     "mean": torch.from_numpy(mean), "std": torch.from_numpy(std)}
            torch.save(state, os.path.join(args.save_dir, "latest.pth"))
            if z[0] < best:
                best = z[0]
                torch.save(state, os.path.join(args.save_dir, "best.pth"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
