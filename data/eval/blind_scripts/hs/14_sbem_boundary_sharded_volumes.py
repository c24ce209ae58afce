"""Cell boundary prediction on serial block-face EM (SBEM) volumes.

The training volumes are large (up to 2k x 4k x 4k) N5 datasets, so every rank keeps only
its own share of the volumes in memory and cuts a regular grid of patches from them.

    torchrun --nproc_per_node=8 14_sbem_boundary_sharded_volumes.py --volumes /nrs/sbem/train/*.n5 \
        --val /nrs/sbem/val/cortex_val.n5 --out /nrs/sbem/runs/bnd_v4
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
import zarr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--volumes", nargs="+", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--raw-key", default="volumes/raw/s1")
    p.add_argument("--bnd-key", default="volumes/boundaries/s1")
    p.add_argument("--patch", type=int, nargs=3, default=[64, 192, 192])
    p.add_argument("--stride", type=int, nargs=3, default=[64, 192, 192])
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--workers", type=int, default=4)
    return p.parse_args()


class GridPatches(Dataset):
    def __init__(self, paths, raw_key, bnd_key, patch, stride, augment=True):
        self.raw = [zarr.open(p, mode="r")[raw_key] for p in paths]
        self.bnd = [zarr.open(p, mode="r")[bnd_key] for p in paths]
        self.patch, self.augment = patch, augment
        self.index = []
        for v, arr in enumerate(self.raw):
            grids = [range(0, s - p + 1, st) for s, p, st in zip(arr.shape, patch, stride)]
            self.index += [(v, z, y, x) for z in grids[0] for y in grids[1] for x in grids[2]]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        v, z, y, x = self.index[i]
        pz, py, px = self.patch
        raw = self.raw[v][z:z + pz, y:y + py, x:x + px].astype(np.float32) / 255.0
        bnd = (self.bnd[v][z:z + pz, y:y + py, x:x + px] > 0).astype(np.float32)
        if self.augment:
            if random.random() < 0.5:
                raw, bnd = raw[:, ::-1], bnd[:, ::-1]
            if random.random() < 0.5:
                raw, bnd = raw[..., ::-1], bnd[..., ::-1]
            g = random.uniform(0.7, 1.4)
            raw = raw ** g
        return torch.from_numpy(np.ascontiguousarray(raw))[None], torch.from_numpy(np.ascontiguousarray(bnd))[None]


class Conv(nn.Sequential):
    def __init__(self, i, o, k):
        p = tuple(x // 2 for x in k)
        super().__init__(nn.Conv3d(i, o, k, padding=p), nn.GroupNorm(4, o), nn.ReLU(inplace=True))


class AnisoUNet(nn.Module):
    """2D convs in the top levels (z anisotropy 25 nm vs 10 nm), 3D below."""

    def __init__(self, f=(24, 48, 96, 192)):
        super().__init__()
        k2, k3 = (1, 3, 3), (3, 3, 3)
        self.e0 = nn.Sequential(Conv(1, f[0], k2), Conv(f[0], f[0], k2))
        self.e1 = nn.Sequential(Conv(f[0], f[1], k2), Conv(f[1], f[1], k2))
        self.e2 = nn.Sequential(Conv(f[1], f[2], k3), Conv(f[2], f[2], k3))
        self.e3 = nn.Sequential(Conv(f[2], f[3], k3), Conv(f[3], f[3], k3))
        self.u2 = nn.ConvTranspose3d(f[3], f[2], 2, 2)
        self.d2 = nn.Sequential(Conv(2 * f[2], f[2], k3), Conv(f[2], f[2], k3))
        self.u1 = nn.ConvTranspose3d(f[2], f[1], (1, 2, 2), (1, 2, 2))
        self.d1 = nn.Sequential(Conv(2 * f[1], f[1], k2), Conv(f[1], f[1], k2))
        self.u0 = nn.ConvTranspose3d(f[1], f[0], (1, 2, 2), (1, 2, 2))
        self.d0 = nn.Sequential(Conv(2 * f[0], f[0], k2), Conv(f[0], f[0], k2))
        self.out = nn.Conv3d(f[0], 1, 1)

    def forward(self, x):
        a = self.e0(x)
        b = self.e1(F.max_pool3d(a, (1, 2, 2)))
        c = self.e2(F.max_pool3d(b, (1, 2, 2)))
        d = self.e3(F.max_pool3d(c, 2))
        y = self.d2(torch.cat([self.u2(d), c], 1))
        y = self.d1(torch.cat([self.u1(y), b], 1))
        y = self.d0(torch.cat([self.u0(y), a], 1))
        return self.out(y)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(1000 + rank)

    paths = sorted(p for pat in args.volumes for p in glob.glob(pat))
    assert len(paths) >= world, f"need at least {world} training volumes, got {len(paths)}"
    my_paths = paths[rank::world]
    train_ds = GridPatches(my_paths, args.raw_key, args.bnd_key, args.patch, args.stride)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_ds = GridPatches([args.val], args.raw_key, args.bnd_key, args.patch, args.patch, augment=False)
    val_idx = list(range(rank, len(val_ds), world))
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, val_idx), batch_size=args.batch_size, num_workers=2)
    print(f"[rank {rank}] {len(my_paths)} volumes, {len(train_ds)} patches", flush=True)

    model = DDP(AnisoUNet().to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    pos_w = torch.tensor(3.0, device=device)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        tl = torch.zeros(2, device=device)
        for raw, bnd in train_dl:
            raw, bnd = raw.to(device, non_blocking=True), bnd.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(raw), bnd, pos_weight=pos_w)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tl += torch.stack([loss.detach(), torch.ones_like(loss)])

        model.eval()
        vs = torch.zeros(3, device=device)
        with torch.no_grad():
            for raw, bnd in val_dl:
                raw, bnd = raw.to(device), bnd.to(device)
                logits = model.module(raw)
                pred = logits > 0
                vs[0] += F.binary_cross_entropy_with_logits(logits, bnd, reduction="sum")
                vs[1] += (pred.float() == bnd).sum()
                vs[2] += bnd.numel()
        dist.all_reduce(tl)
        dist.all_reduce(vs)
        if rank == 0:
            print(f"epoch {epoch} train {(tl[0] / tl[1]).item():.4f} val bce {(vs[0] / vs[2]).item():.4f} "
                  f"acc {(vs[1] / vs[2]).item():.4f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.out, f"epoch_{epoch:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
