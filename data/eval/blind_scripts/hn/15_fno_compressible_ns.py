"""FNO for 2D compressible Navier-Stokes (PDEBench CFD, M=0.1, periodic, 128^2).

Reading the 4 fields straight from the PDEBench HDF5 file is slow (chunked per
variable, float32, gzip), so on first use the file is converted into a
normalised float16 memmap next to the data, plus a JSON with the per-field statistics.

    torchrun --standalone --nproc_per_node=8 15_fno_compressible_ns.py \
        --h5 /data/pdebench/2D/CFD/2D_CFD_Rand_M0.1_Eta0.01_Zeta0.01_periodic_128_Train.hdf5 \
        --cache-dir /data/pdebench/cache
"""
import argparse
import json
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

FIELDS = ("density", "pressure", "Vx", "Vy")


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--h5", required=True)
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--n-test", type=int, default=1000)
    ap.add_argument("--history", type=int, default=10)
    ap.add_argument("--modes", type=int, default=16)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--ckpt", default="runs/cfd_fno/model.pt")
    return ap.parse_args()


def build_cache(h5_path, cache_dir):
    """Returns (memmap path, stats). Layout of the memmap: [N, T, C, H, W] float16, normalised."""
    os.makedirs(cache_dir, exist_ok=True)
    stem = os.path.splitext(os.path.basename(h5_path))[0]
    arr_path = os.path.join(cache_dir, stem + ".f16.npy")
    stats_path = os.path.join(cache_dir, stem + ".stats.json")
    if os.path.exists(stats_path):
        with open(stats_path) as fh:
            return arr_path, json.load(fh)

    with h5py.File(h5_path, "r") as f:
        N, T, H, W = f["density"].shape
        stats = {}
        for k in FIELDS:
            s, ss, n = 0.0, 0.0, 0
            for i in range(0, N, 100):
                blk = f[k][i:i + 100].astype(np.float64)
                s += blk.sum()
                ss += (blk ** 2).sum()
                n += blk.size
            mean = s / n
            stats[k] = {"mean": mean, "std": float(np.sqrt(ss / n - mean ** 2))}
        out = np.lib.format.open_memmap(arr_path, mode="w+", dtype=np.float16, shape=(N, T, len(FIELDS), H, W))
        for i in range(0, N, 100):
            for c, k in enumerate(FIELDS):
                out[i:i + 100, :, c] = ((f[k][i:i + 100] - stats[k]["mean"]) / stats[k]["std"]).astype(np.float16)
        out.flush()
        del out
    with open(stats_path, "w") as fh:
        json.dump(stats, fh)
    return arr_path, stats


class CFDWindows(Dataset):
    def __init__(self, arr_path, history):
        self.arr_path, self.history = arr_path, history
        arr = np.load(arr_path, mmap_mode="r")
        self.N, self.T = arr.shape[:2]
        self.arr = None

    def __len__(self):
        return self.N * (self.T - self.history)

    def __getitem__(self, idx):
        if self.arr is None:
            self.arr = np.load(self.arr_path, mmap_mode="r")
        n, t = divmod(idx, self.T - self.history)
        w = np.asarray(self.arr[n, t:t + self.history + 1], dtype=np.float32)
        return torch.from_numpy(w[:-1]), torch.from_numpy(w[-1])


class SpectralConv2d(nn.Module):
    def __init__(self, c_in, c_out, modes):
        super().__init__()
        self.modes = modes
        s = 1 / (c_in * c_out)
        self.w1 = nn.Parameter(s * torch.rand(c_in, c_out, modes, modes, dtype=torch.cfloat))
        self.w2 = nn.Parameter(s * torch.rand(c_in, c_out, modes, modes, dtype=torch.cfloat))

    def forward(self, x):
        m = self.modes
        xf = torch.fft.rfft2(x)
        of = torch.zeros(x.shape[0], self.w1.shape[1], x.shape[-2], x.shape[-1] // 2 + 1, dtype=torch.cfloat, device=x.device)
        of[:, :, :m, :m] = torch.einsum("bixy,ioxy->boxy", xf[:, :, :m, :m], self.w1)
        of[:, :, -m:, :m] = torch.einsum("bixy,ioxy->boxy", xf[:, :, -m:, :m], self.w2)
        return torch.fft.irfft2(of, s=x.shape[-2:])


class CFDFNO(nn.Module):
    def __init__(self, history, channels, modes, width, layers=4):
        super().__init__()
        self.lift = nn.Conv2d(history * channels, width, 1)
        self.spectral = nn.ModuleList(SpectralConv2d(width, width, modes) for _ in range(layers))
        self.local = nn.ModuleList(nn.Conv2d(width, width, 1) for _ in range(layers))
        self.proj = nn.Sequential(nn.Conv2d(width, 128, 1), nn.GELU(), nn.Conv2d(128, channels, 1))

    def forward(self, x):
        b, h, c, H, W = x.shape
        z = self.lift(x.reshape(b, h * c, H, W))
        for i, (sp, lo) in enumerate(zip(self.spectral, self.local)):
            z = sp(z) + lo(z)
            if i < len(self.spectral) - 1:
                z = F.gelu(z)
        return x[:, -1] + self.proj(z)


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    arr_path, stats = build_cache(args.h5, args.cache_dir)
    full = CFDWindows(arr_path, args.history)
    per_traj = full.T - args.history
    n_train_traj = full.N - args.n_test
    train_ds = Subset(full, range(0, n_train_traj * per_traj))
    test_ds = Subset(full, range(n_train_traj * per_traj, full.N * per_traj))
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    test_loader = DataLoader(Subset(test_ds, range(rank, len(test_ds), world)), batch_size=64, num_workers=4)

    model = DDP(CFDFNO(args.history, len(FIELDS), args.modes, args.width).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    if rank == 0:
        os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
        print("field stats:", json.dumps(stats), flush=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()

        model.eval()
        err = torch.zeros(len(FIELDS) + 1, device=device, dtype=torch.float64)
        with torch.no_grad():
            for x, y in test_loader:
                x, y = x.to(device), y.to(device)
                p = model.module(x)
                err[:-1] += ((p - y) ** 2).mean(dim=(2, 3)).sum(0).double()
                err[-1] += x.shape[0]
        dist.all_reduce(acc)
        dist.all_reduce(err)
        if rank == 0:
            rmse = (err[:-1] / err[-1]).sqrt().tolist()
            per_field = " ".join(f"{k}={v * stats[k]['std']:.3e}" for k, v in zip(FIELDS, rmse))
            print(f"epoch {epoch:3d} {time.time() - t0:6.1f}s train {(acc[0] / acc[1]).item():.4e} | test RMSE {per_field}",
                  flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch,
                        "stats": stats, "history": args.history}, args.ckpt)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
