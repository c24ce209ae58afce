#!/usr/bin/env python
"""
Noise2Noise denoising of light-sheet time-lapses (zebrafish, mesoSPIM / Viventis).

Each time point was recorded twice in quick succession (dual acquisition mode),
giving pairs <pos>/t####_a.tif and <pos>/t####_b.tif, each (Z, Y, X) ~ 2-4 GB.
Random 2D slabs are cut from the stacks.  Percentile normalisation of the big
tiles was the bottleneck on the CPU, so it is done with torch.quantile on the
GPU.

    torchrun --nproc_per_node=4 12_lightsheet_denoise.py --root /data/ls/zf_0412 --out runs/ls_n2n
"""
import argparse
import glob
import os
import time

import numpy as np
import tifffile
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tile", type=int, default=512)
    ap.add_argument("--tiles-per-stack", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--val-positions", nargs="*", default=["pos07"])
    return ap.parse_args()


class DualAcqTiles(Dataset):
    def __init__(self, pairs, tile, tiles_per_stack, device, seed=0):
        self.pairs = pairs
        self.tile = tile
        self.device = device
        rng = np.random.default_rng(seed)
        self.index = []
        for p, (fa, _) in enumerate(pairs):
            Z, Y, X = tifffile.TiffFile(fa).series[0].shape
            for _ in range(tiles_per_stack):
                self.index.append((p, int(rng.integers(Z)), int(rng.integers(0, Y - tile + 1)),
                                   int(rng.integers(0, X - tile + 1))))

    def __len__(self):
        return len(self.index)

    def _normalize(self, a, b):
        # joint percentiles of both acquisitions so the pair stays on one scale
        ta = torch.from_numpy(a).to(self.device, non_blocking=True)
        tb = torch.from_numpy(b).to(self.device, non_blocking=True)
        both = torch.cat([ta.flatten(), tb.flatten()])
        lo, hi = torch.quantile(both[:: max(1, both.numel() // 2 ** 20)], torch.tensor([0.003, 0.997], device=self.device))
        scale = (hi - lo).clamp(min=1.0)
        return ((ta - lo) / scale).cpu(), ((tb - lo) / scale).cpu()

    def __getitem__(self, i):
        p, z, y, x = self.index[i]
        fa, fb = self.pairs[p]
        t = self.tile
        a = tifffile.memmap(fa, mode="r")[z, y:y + t, x:x + t].astype(np.float32)
        b = tifffile.memmap(fb, mode="r")[z, y:y + t, x:x + t].astype(np.float32)
        a, b = self._normalize(a, b)
        if torch.rand(1).item() < 0.5:
            a, b = b, a
        if torch.rand(1).item() < 0.5:
            a, b = a.flip(-1), b.flip(-1)
        return a[None], b[None]


class ResUNet(nn.Module):
    def __init__(self, c=32):
        super().__init__()

        def blk(i, o):
            return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.GroupNorm(8, o), nn.GELU(),
                                 nn.Conv2d(o, o, 3, padding=1), nn.GroupNorm(8, o), nn.GELU())

        self.e1, self.e2, self.e3 = blk(1, c), blk(c, 2 * c), blk(2 * c, 4 * c)
        self.bott = blk(4 * c, 8 * c)
        self.u3, self.d3 = nn.ConvTranspose2d(8 * c, 4 * c, 2, 2), blk(8 * c, 4 * c)
        self.u2, self.d2 = nn.ConvTranspose2d(4 * c, 2 * c, 2, 2), blk(4 * c, 2 * c)
        self.u1, self.d1 = nn.ConvTranspose2d(2 * c, c, 2, 2), blk(2 * c, c)
        self.out = nn.Conv2d(c, 1, 1)

    def forward(self, x):
        e1 = self.e1(x)
        e2 = self.e2(F.max_pool2d(e1, 2))
        e3 = self.e3(F.max_pool2d(e2, 2))
        b = self.bott(F.max_pool2d(e3, 2))
        d = self.d3(torch.cat([self.u3(b), e3], 1))
        d = self.d2(torch.cat([self.u2(d), e2], 1))
        d = self.d1(torch.cat([self.u1(d), e1], 1))
        return x + self.out(d)


def list_pairs(root, positions):
    pairs = []
    for pos in positions:
        for fa in sorted(glob.glob(os.path.join(root, pos, "t*_a.tif"))):
            pairs.append((fa, fa[:-6] + "_b.tif"))
    return pairs


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    positions = sorted(os.path.basename(p) for p in glob.glob(os.path.join(args.root, "pos*")))
    train_pos = [p for p in positions if p not in args.val_positions]
    train_ds = DualAcqTiles(list_pairs(args.root, train_pos), args.tile, args.tiles_per_stack, device, seed=0)
    val_ds = DualAcqTiles(list_pairs(args.root, args.val_positions), args.tile, 16, device, seed=1)

    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                          num_workers=args.workers, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler, num_workers=args.workers)

    model = DDP(ResUNet().to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(train_ds)} train tiles, {len(val_ds)} val tiles, {world} GPUs", flush=True)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tr = torch.zeros(2, device=device)
        for a, b in train_dl:
            a, b = a.to(device, non_blocking=True), b.to(device, non_blocking=True)
            loss = F.mse_loss(model(a), b)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tr += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()

        model.eval()
        va = torch.zeros(2, device=device)
        with torch.no_grad():
            for a, b in val_dl:
                a, b = a.to(device), b.to(device)
                va += torch.stack([F.mse_loss(model.module(a), b), torch.ones((), device=device)])
        dist.all_reduce(tr)
        dist.all_reduce(va)
        if rank == 0:
            print(f"epoch {epoch:3d}  train {tr[0] / tr[1]:.5f}  val {va[0] / va[1]:.5f}  "
                  f"{time.time() - t0:.0f}s", flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "opt": opt.state_dict()},
                       os.path.join(args.out, "ls_n2n_last.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
