#!/usr/bin/env python
# Membrane segmentation for serial-section TEM (ssTEM) volumes.
#
# Raw volumes and membrane masks are multi-page TIFF stacks (Z, Y, X).  We
# train a 2D U-Net on random XY tiles with elastic-ish augmentation; each tile
# is CLAHE-free but percentile-normalised on its own.
#
#   torchrun --nproc_per_node=8 05_sstem_membrane_seg.py \
#       --raw /data/sstem/vol*_raw.tif --mask /data/sstem/vol*_mem.tif \
#       --out /data/models/membranes --wandb-project membrane-seg
import argparse
import glob
import os
import random
import time

import numpy as np
import tifffile
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--raw", nargs="+", required=True)
    p.add_argument("--mask", nargs="+", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--val-slices", type=int, default=20, help="last N slices of each volume")
    p.add_argument("--tile", type=int, default=320)
    p.add_argument("--samples-per-epoch", type=int, default=16000)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--wandb-project", default="membrane-seg")
    p.add_argument("--run-name", default=None)
    return p.parse_args()


class StackTiles(Dataset):
    def __init__(self, raws, masks, z_range, tile, n_samples, train=True):
        # volumes are a few GB each, so they are memory-mapped, not read
        self.raws = [tifffile.memmap(r, mode="r") for r in raws]
        self.masks = [tifffile.memmap(m, mode="r") for m in masks]
        self.z_range = z_range
        self.tile = tile
        self.n = n_samples
        self.train = train

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        rng = random.Random(i) if not self.train else random
        v = rng.randrange(len(self.raws))
        z0, z1 = self.z_range(self.raws[v].shape[0])
        z = rng.randrange(z0, z1)
        _, H, W = self.raws[v].shape
        t = self.tile
        y, x = rng.randrange(H - t), rng.randrange(W - t)
        img = np.asarray(self.raws[v][z, y:y + t, x:x + t], dtype=np.float32)
        msk = np.asarray(self.masks[v][z, y:y + t, x:x + t] > 0, dtype=np.float32)
        lo, hi = np.percentile(img, (1, 99))
        img = (img - lo) / (hi - lo + 1e-6)
        if self.train:
            k = rng.randrange(4)
            img, msk = np.rot90(img, k), np.rot90(msk, k)
            if rng.random() < 0.5:
                img, msk = img[:, ::-1], msk[:, ::-1]
            img = img * rng.uniform(0.8, 1.2) + rng.uniform(-0.1, 0.1)  # contrast/brightness jitter
        return torch.from_numpy(img.copy())[None], torch.from_numpy(msk.copy())[None]


class Down(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.InstanceNorm2d(cout, affine=True),
                                  nn.LeakyReLU(0.01, True), nn.Conv2d(cout, cout, 3, padding=1),
                                  nn.InstanceNorm2d(cout, affine=True), nn.LeakyReLU(0.01, True))

    def forward(self, x):
        return self.conv(x)


class MembraneUNet(nn.Module):
    def __init__(self, f=(24, 48, 96, 192, 384)):
        super().__init__()
        self.enc = nn.ModuleList([Down(1 if i == 0 else f[i - 1], f[i]) for i in range(len(f))])
        self.up = nn.ModuleList([nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
                                 for _ in range(len(f) - 1)])
        self.dec = nn.ModuleList([Down(f[i] + f[i + 1], f[i]) for i in reversed(range(len(f) - 1))])
        self.head = nn.Conv2d(f[0], 1, 1)

    def forward(self, x):
        s = []
        for i, e in enumerate(self.enc):
            x = e(x if i == 0 else F.max_pool2d(x, 2))
            s.append(x)
        s.pop()
        for up, d in zip(self.up, self.dec):
            x = d(torch.cat([up(x), s.pop()], 1))
        return self.head(x)


def soft_dice_loss(logits, target, eps=1.0):
    p = torch.sigmoid(logits)
    num = 2 * (p * target).sum((1, 2, 3)) + eps
    den = p.sum((1, 2, 3)) + target.sum((1, 2, 3)) + eps
    return 1 - (num / den).mean()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    raws = sorted(f for pat in args.raw for f in glob.glob(pat))
    masks = sorted(f for pat in args.mask for f in glob.glob(pat))
    assert len(raws) == len(masks) and raws, "raw / mask lists do not match"

    nv = args.val_slices
    train_ds = StackTiles(raws, masks, lambda Z: (0, Z - nv), args.tile, args.samples_per_epoch, train=True)
    val_ds = StackTiles(raws, masks, lambda Z: (Z - nv, Z), args.tile, 512, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                          num_workers=args.workers, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler, num_workers=2)

    model = DDP(MembraneUNet().to(device), device_ids=[local_rank])
    lr = args.lr * world
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    warmup = 500
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + np.cos(np.pi * min(s, total) / total)))

    wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args))
    if is_main:
        os.makedirs(args.out, exist_ok=True)
        print(f"train tiles/epoch {len(train_ds)}, world {world}, lr {lr:.2e}", flush=True)

    best = 0.0
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for img, msk in train_dl:
            img, msk = img.to(device, non_blocking=True), msk.to(device, non_blocking=True)
            logits = model(img)
            loss = F.binary_cross_entropy_with_logits(logits, msk) + soft_dice_loss(logits, msk)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if step % 50 == 0:
                wandb.log({"train/loss": loss.item(), "lr": sched.get_last_lr()[0]}, step=step)

        model.eval()
        stats = torch.zeros(3, device=device)  # intersection, sum pred, sum target
        with torch.no_grad():
            for img, msk in val_dl:
                img, msk = img.to(device), msk.to(device)
                pred = (model.module(img) > 0).float()
                stats += torch.stack([(pred * msk).sum(), pred.sum(), msk.sum()])
        dist.all_reduce(stats)
        dice = (2 * stats[0] / (stats[1] + stats[2]).clamp(min=1)).item()
        wandb.log({"val/dice": dice, "epoch": epoch}, step=step)

        if is_main:
            print(f"epoch {epoch}  val dice {dice:.4f}  ({time.time() - t0:.0f}s)", flush=True)
            state = {"model": model.module.state_dict(), "epoch": epoch, "dice": dice}
            torch.save(state, os.path.join(args.out, "last.pth"))
            if dice > best:
                best = dice
                torch.save(state, os.path.join(args.out, "best.pth"))

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
