"""Spherical Fourier Neural Operator trained to predict normalized 6 h tendencies.

Inputs are normalized with per-channel climatological mean/std, targets (x_{t+1} - x_t)
with the per-channel std of the 6 h differences, as in GraphCast.

    torchrun --nproc_per_node=4 07_sfno_residual_stats.py --data-dir /scratch/era5_721x1440
"""
import argparse
import glob
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch_harmonics as th
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger(__name__)


def year_files(data_dir, years):
    return [os.path.join(data_dir, f"{y}.npy") for y in years
            if os.path.exists(os.path.join(data_dir, f"{y}.npy"))]


def get_stats(data_dir, train_years, every=20):
    path = os.path.join(data_dir, f"stats_{train_years[0]}_{train_years[-1]}.npz")
    if not os.path.exists(path):
        s1 = s2 = d2 = None
        n = nd = 0
        for f in year_files(data_dir, train_years):
            a = np.load(f, mmap_mode="r")
            x = np.asarray(a[::every], dtype=np.float64)
            d = np.asarray(a[1::every], dtype=np.float64) - x[: len(a[1::every])]
            if s1 is None:
                s1 = np.zeros(x.shape[1]); s2 = np.zeros(x.shape[1]); d2 = np.zeros(x.shape[1])
            s1 += x.sum(axis=(0, 2, 3)); s2 += (x ** 2).sum(axis=(0, 2, 3))
            d2 += (d ** 2).sum(axis=(0, 2, 3))
            n += x.shape[0] * x.shape[2] * x.shape[3]
            nd += d.shape[0] * d.shape[2] * d.shape[3]
        mean = s1 / n
        std = np.sqrt(s2 / n - mean ** 2)
        diff_std = np.sqrt(d2 / nd)
        np.savez(path, mean=mean, std=std, diff_std=diff_std)
    st = np.load(path)
    return st["mean"].astype(np.float32), st["std"].astype(np.float32), st["diff_std"].astype(np.float32)


class TendencyDataset(Dataset):
    def __init__(self, files, mean, std, diff_std):
        self.arrs = [np.load(f, mmap_mode="r") for f in files]
        self.items = [(k, t) for k, a in enumerate(self.arrs) for t in range(a.shape[0] - 1)]
        self.mean, self.std = mean[:, None, None], std[:, None, None]
        self.dstd = diff_std[:, None, None]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        k, t = self.items[i]
        x0 = np.asarray(self.arrs[k][t], dtype=np.float32)
        x1 = np.asarray(self.arrs[k][t + 1], dtype=np.float32)
        inp = (x0 - self.mean) / self.std
        tgt = (x1 - x0) / self.dstd
        return torch.from_numpy(inp), torch.from_numpy(tgt)


class SpectralBlock(nn.Module):
    def __init__(self, sht, isht, dim, lmax, mmax):
        super().__init__()
        self.sht, self.isht = sht, isht
        scale = 1.0 / dim
        self.w = nn.Parameter(scale * torch.randn(dim, dim, lmax, 2))
        self.skip = nn.Conv2d(dim, dim, 1)
        self.norm = nn.InstanceNorm2d(dim, affine=True)
        self.mlp = nn.Sequential(nn.Conv2d(dim, 2 * dim, 1), nn.GELU(), nn.Conv2d(2 * dim, dim, 1))
        self.lmax, self.mmax = lmax, mmax

    def forward(self, x):
        c = self.sht(x)
        w = torch.view_as_complex(self.w)
        c = torch.einsum("bilm,iol->bolm", c, w)
        y = self.isht(c)
        x = self.norm(y + self.skip(x))
        return x + self.mlp(x)


class SFNO(nn.Module):
    def __init__(self, ch, dim=256, depth=8, nlat=721, nlon=1440, scale=2):
        super().__init__()
        hl, hw = (nlat + 1) // scale, nlon // scale
        lmax, mmax = hl, hw // 2 + 1
        self.down = th.RealSHT(nlat, nlon, lmax=lmax, mmax=mmax, grid="equiangular").float()
        self.up = th.InverseRealSHT(nlat, nlon, lmax=lmax, mmax=mmax, grid="equiangular").float()
        sht = th.RealSHT(hl, hw, lmax=lmax, mmax=mmax, grid="legendre-gauss").float()
        isht = th.InverseRealSHT(hl, hw, lmax=lmax, mmax=mmax, grid="legendre-gauss").float()
        self.sht_half, self.isht_half = sht, isht
        self.lift = nn.Conv2d(ch, dim, 1)
        self.blocks = nn.ModuleList([SpectralBlock(sht, isht, dim, lmax, mmax) for _ in range(depth)])
        self.proj = nn.Conv2d(dim, ch, 1)

    def forward(self, x):
        # full grid -> coarser Gaussian grid, process, back to the full grid
        x = self.isht_half(self.down(x))
        x = self.lift(x)
        for b in self.blocks:
            x = b(x)
        x = self.proj(x)
        return self.up(self.sht_half(x))


def lat_weights(nlat, device):
    lat = torch.linspace(90, -90, nlat, device=device)
    w = torch.cos(torch.deg2rad(lat)).clamp_min(0)
    return (w / w.mean()).view(1, 1, -1, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--out-dir", default="./sfno_out")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=1, help="per GPU")
    ap.add_argument("--lr", type=float, default=5e-4, help="for 4 GPUs x batch 1")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--depth", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR)

    train_years, val_years = list(range(1979, 2016)), [2016, 2017]
    mean, std, dstd = get_stats(args.data_dir, train_years)
    train_ds = TendencyDataset(year_files(args.data_dir, train_years), mean, std, dstd)
    val_full = TendencyDataset(year_files(args.data_dir, val_years), mean, std, dstd)
    val_ds = Subset(val_full, range(rank, len(val_full), 4 * world))

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size, num_workers=4, pin_memory=True)

    net = SFNO(len(mean), args.dim, args.depth).to(device)
    # the only buffers are the fixed SHT quadrature/Legendre tables
    model = DDP(net, device_ids=[local_rank], broadcast_buffers=False)
    lr = args.lr * world * args.batch_size / 4
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_dl))

    w = lat_weights(721, device)
    dstd_t = torch.from_numpy(dstd).to(device).view(1, -1, 1, 1)
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        logger.info("train %d val %d world %d lr %.2e", len(train_ds), len(val_full), world, lr)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for it, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            pred = model(x)
            loss = ((pred - y) ** 2 * w).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if it % 200 == 0:
                logger.info("ep %d it %d loss %.4f", epoch, it, loss.item())

        net.eval()
        acc = torch.zeros(len(mean) + 1, dtype=torch.float64, device=device)
        with torch.no_grad():
            for x, y in val_dl:
                x, y = x.to(device), y.to(device)
                pred = net(x)
                err = ((pred - y) * dstd_t) ** 2
                acc[:-1] += (err * w).mean(dim=(-2, -1)).sqrt().sum(0).double()
                acc[-1] += x.shape[0]
        dist.all_reduce(acc)
        rmse = acc[:-1] / acc[-1]
        if rank == 0:
            logger.info("epoch %d (%.0fs) val rmse mean over channels %.4f", epoch, time.time() - tic,
                        rmse.mean().item())
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch,
                        "mean": mean.tolist(), "std": std.tolist(), "diff_std": dstd.tolist()},
                       os.path.join(args.out_dir, f"epoch_{epoch:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
