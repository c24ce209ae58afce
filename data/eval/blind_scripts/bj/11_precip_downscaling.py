"""Super-resolution downscaling of daily precipitation: ERA5 (0.25 deg) predictors ->
4 km gridded observations over the Alps.  Training years are streamed from yearly
NetCDF files (one file = one year of daily fields) so nothing has to fit in memory.

    srun --ntasks-per-node=1 torchrun --nnodes=2 --nproc_per_node=4 \
        --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 11_precip_downscaling.py
"""
import argparse
import glob
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import xarray as xr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

PREDICTORS = ["tp", "t2m", "msl", "z500", "q850", "u850", "v850"]


class YearStream(IterableDataset):
    """Streams (coarse predictors, fine precipitation) pairs from yearly files.

    Files are distributed over ranks and then over the loader workers of each rank."""

    def __init__(self, files, stats, rank, world_size, shuffle=True, buffer=256, seed=0):
        self.files = sorted(files)
        self.stats = stats
        self.rank, self.world_size = rank, world_size
        self.shuffle, self.buffer, self.seed = shuffle, buffer, seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _samples(self, path):
        with xr.open_dataset(path) as ds:
            x = np.stack([ds[v].values for v in PREDICTORS], axis=1).astype(np.float32)  # (days, C, h, w)
            y = ds["precip_obs"].values.astype(np.float32)  # (days, H, W)
        x = (x - self.stats["mean"][None, :, None, None]) / self.stats["std"][None, :, None, None]
        y = np.log1p(y)
        for d in range(x.shape[0]):
            yield torch.from_numpy(x[d]), torch.from_numpy(y[d])[None]

    def __iter__(self):
        rng = random.Random(self.seed + self.epoch)
        files = list(self.files)
        if self.shuffle:
            rng.shuffle(files)
        files = files[self.rank:: self.world_size]
        wi = get_worker_info()
        if wi is not None:
            files = files[wi.id:: wi.num_workers]
        buf = []
        local_rng = random.Random(self.seed + self.epoch * 1000 + self.rank * 10 + (wi.id if wi else 0))
        for path in files:
            for sample in self._samples(path):
                if not self.shuffle:
                    yield sample
                    continue
                buf.append(sample)
                if len(buf) >= self.buffer:
                    yield buf.pop(local_rng.randrange(len(buf)))
        local_rng.shuffle(buf)
        yield from buf


class ResidualBlock(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(ch, ch, 3, padding=1), nn.GELU(), nn.Conv2d(ch, ch, 3, padding=1))

    def forward(self, x):
        return x + 0.2 * self.body(x)


class DownscalingNet(nn.Module):
    def __init__(self, cin, ch=96, n_blocks=12, scale=8, topo=None):
        super().__init__()
        self.register_buffer("topo", topo)  # (1, 1, H, W) normalised orography of the fine grid
        self.head = nn.Conv2d(cin, ch, 3, padding=1)
        self.body = nn.Sequential(*[ResidualBlock(ch) for _ in range(n_blocks)])
        ups = []
        for _ in range(int(np.log2(scale))):
            ups += [nn.Conv2d(ch, 4 * ch, 3, padding=1), nn.PixelShuffle(2), nn.GELU()]
        self.up = nn.Sequential(*ups)
        self.fuse = nn.Sequential(nn.Conv2d(ch + 1, ch, 3, padding=1), nn.GELU(), nn.Conv2d(ch, 1, 3, padding=1))

    def forward(self, x):
        h = self.up(self.body(self.head(x)))
        h = h[..., : self.topo.shape[-2], : self.topo.shape[-1]]
        topo = self.topo.expand(h.shape[0], -1, -1, -1)
        return F.softplus(self.fuse(torch.cat([h, topo], 1)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", default="/scratch/snx3000/clim/downscaling/yearly")
    ap.add_argument("--stats", default="/scratch/snx3000/clim/downscaling/predictor_stats.npz")
    ap.add_argument("--topo", default="/scratch/snx3000/clim/downscaling/topo_4km.npy")
    ap.add_argument("--train-years", default="1981-2014")
    ap.add_argument("--val-years", default="2015-2019")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--ckpt-dir", default="/scratch/snx3000/clim/runs/downscaling")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    def year_files(spec):
        a, b = map(int, spec.split("-"))
        return [os.path.join(args.data_dir, f"{y}.nc") for y in range(a, b + 1)]

    stats = dict(np.load(args.stats))
    topo = torch.from_numpy(np.load(args.topo)).float()[None, None]
    train_ds = YearStream(year_files(args.train_years), stats, rank, world, shuffle=True)
    val_ds = YearStream(year_files(args.val_years), stats, rank, world, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, num_workers=args.workers, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=16, num_workers=2)

    model = DownscalingNet(len(PREDICTORS), topo=topo).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[15, 25], gamma=0.3)

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
    for epoch in range(args.epochs):
        train_ds.set_epoch(epoch)
        model.train()
        t0 = time.time()
        agg = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            pred = model(x)
            # weighted L1 in log space, heavier weight on wet pixels
            w = 1.0 + 4.0 * (y > np.log1p(1.0)).float()
            loss = (w * (pred - y).abs()).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            agg += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()

        model.eval()
        v = torch.zeros(4, device=device)  # abs err, sq err, n pixels, n days
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device), y.to(device)
                pred_mm = torch.expm1(model.module(x))
                obs_mm = torch.expm1(y)
                v[0] += (pred_mm - obs_mm).abs().sum()
                v[1] += ((pred_mm - obs_mm) ** 2).sum()
                v[2] += obs_mm.numel()
                v[3] += x.shape[0]
        dist.all_reduce(agg)
        dist.all_reduce(v)
        if rank == 0:
            print(f"epoch {epoch:02d} train {agg[0] / agg[1]:.4f} | val MAE {v[0] / v[2]:.3f} mm/d "
                  f"RMSE {(v[1] / v[2]).sqrt():.3f} mm/d over {int(v[3])} days | {time.time() - t0:.0f}s", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.ckpt_dir, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
