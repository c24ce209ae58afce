#!/usr/bin/env python
"""
Boundary prediction for connectomics-style EM (neuron membranes), with deep
supervision on the two coarsest decoder levels during the first epochs.

Data: one raw volume (Z, Y, X) uint8 as .tif and a boundary probability /
mask volume of the same shape.  Training samples are anisotropic 2.5D tiles
(5 consecutive sections as channels, predict the middle one).

    torchrun --nnodes=1 --nproc_per_node=4 11_em_boundary_unet.py \
        --raw /nrs/em/cremi_A_raw.tif --bnd /nrs/em/cremi_A_boundaries.tif --out /nrs/em/runs/bnd_A
"""
import argparse
import logging
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

logger = logging.getLogger("bnd")


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--raw", required=True)
    p.add_argument("--bnd", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--context", type=int, default=2, help="sections above/below")
    p.add_argument("--tile", type=int, default=256)
    p.add_argument("--n-tiles", type=int, default=20000)
    p.add_argument("--val-z", type=int, default=16, help="last sections kept for validation")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--aux-epochs", type=int, default=10, help="deep supervision only for the first N epochs")
    p.add_argument("--aux-weight", type=float, default=0.4)
    p.add_argument("--workers", type=int, default=8)
    return p


class Sections25D(Dataset):
    def __init__(self, raw, bnd, z_lo, z_hi, ctx, tile, n, seed):
        self.raw_path, self.bnd_path = raw, bnd
        self.ctx, self.tile = ctx, tile
        rng = np.random.default_rng(seed)
        shape = tifffile.TiffFile(raw).series[0].shape
        H, W = shape[1:]
        self.samples = np.stack([rng.integers(z_lo + ctx, z_hi - ctx, n),
                                 rng.integers(0, H - tile, n), rng.integers(0, W - tile, n)], 1)
        self.raw = self.bnd = None

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        if self.raw is None:
            self.raw = tifffile.memmap(self.raw_path, mode="r")
            self.bnd = tifffile.memmap(self.bnd_path, mode="r")
        z, y, x = self.samples[i]
        c, t = self.ctx, self.tile
        img = np.asarray(self.raw[z - c:z + c + 1, y:y + t, x:x + t], dtype=np.float32)
        img = (img - img.mean()) / (img.std() + 1e-5)
        tgt = (np.asarray(self.bnd[z, y:y + t, x:x + t]) > 127).astype(np.float32)
        k = np.random.randint(4)
        img, tgt = np.rot90(img, k, (1, 2)).copy(), np.rot90(tgt, k).copy()
        return torch.from_numpy(img), torch.from_numpy(tgt)[None]


def cbr(i, o):
    return nn.Sequential(nn.Conv2d(i, o, 3, padding=1, bias=False), nn.GroupNorm(8, o), nn.ReLU(True),
                         nn.Conv2d(o, o, 3, padding=1, bias=False), nn.GroupNorm(8, o), nn.ReLU(True))


class DSUNet(nn.Module):
    """U-Net returning the full-res logits plus two coarse auxiliary logits"""

    def __init__(self, cin=5, w=(32, 64, 128, 256, 512)):
        super().__init__()
        self.enc = nn.ModuleList([cbr(cin if i == 0 else w[i - 1], w[i]) for i in range(len(w))])
        self.up = nn.ModuleList([nn.ConvTranspose2d(w[i + 1], w[i], 2, 2) for i in reversed(range(len(w) - 1))])
        self.dec = nn.ModuleList([cbr(2 * w[i], w[i]) for i in reversed(range(len(w) - 1))])
        self.head = nn.Conv2d(w[0], 1, 1)
        self.aux_heads = nn.ModuleList([nn.Conv2d(w[3], 1, 1), nn.Conv2d(w[2], 1, 1)])

    def forward(self, x):
        skips = []
        for i, e in enumerate(self.enc):
            x = e(x if i == 0 else F.max_pool2d(x, 2))
            skips.append(x)
        skips.pop()
        aux = []
        for j, (u, d) in enumerate(zip(self.up, self.dec)):
            x = d(torch.cat([u(x), skips.pop()], 1))
            if j < len(self.aux_heads):
                aux.append(self.aux_heads[j](x))
        return self.head(x), aux


def bce_dice(logits, tgt):
    p = torch.sigmoid(logits)
    dice = 1 - (2 * (p * tgt).sum() + 1) / (p.sum() + tgt.sum() + 1)
    return F.binary_cross_entropy_with_logits(logits, tgt) + dice


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")

    Z = tifffile.TiffFile(args.raw).series[0].shape[0]
    split = Z - args.val_z
    train_ds = Sections25D(args.raw, args.bnd, 0, split, args.context, args.tile, args.n_tiles, seed=0)
    val_ds = Sections25D(args.raw, args.bnd, split, Z, args.context, args.tile, 512, seed=1)
    tr_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    va_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    tr_dl = DataLoader(train_ds, args.batch_size, sampler=tr_sampler, num_workers=args.workers,
                       pin_memory=True, drop_last=True)
    va_dl = DataLoader(val_ds, args.batch_size, sampler=va_sampler, num_workers=4)

    model = DDP(DSUNet(cin=2 * args.context + 1).to(dev), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * world, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr * world,
                                                total_steps=args.epochs * len(tr_dl), pct_start=0.1)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = float("inf")
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        aux_weight = args.aux_weight if epoch < args.aux_epochs else 0.0
        t0 = time.time()
        acc = torch.zeros(2, device=dev)
        for img, tgt in tr_dl:
            img, tgt = img.to(dev, non_blocking=True), tgt.to(dev, non_blocking=True)
            logits, aux = model(img)
            loss = bce_dice(logits, tgt)
            if aux_weight > 0:
                for a in aux:
                    loss = loss + aux_weight * bce_dice(a, F.adaptive_max_pool2d(tgt, a.shape[-2:]))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=dev)])

        model.eval()
        vacc = torch.zeros(2, device=dev)
        with torch.no_grad():
            for img, tgt in va_dl:
                logits, _ = model.module(img.to(dev))
                vacc += torch.stack([bce_dice(logits, tgt.to(dev)), torch.ones((), device=dev)])
        dist.all_reduce(acc)
        dist.all_reduce(vacc)
        tr_loss, va_loss = (acc[0] / acc[1]).item(), (vacc[0] / vacc[1]).item()
        logger.info("epoch %d  aux_w %.2f  train %.4f  val %.4f  %.0fs", epoch, aux_weight, tr_loss, va_loss,
                    time.time() - t0)
        if rank == 0 and va_loss < best:
            best = va_loss
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "args": vars(args)},
                       os.path.join(args.out, "boundary_best.pt"))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
