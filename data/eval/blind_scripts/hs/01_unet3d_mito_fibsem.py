#!/usr/bin/env python
"""3D U-Net for mitochondria segmentation in FIB-SEM stacks (MitoEM / Lucchi++ style).

Training volumes are HDF5 files with datasets ``raw`` (uint8, ZYX) and ``label``
(uint8, 0/1).  Patches are cut on a regular grid with overlap and randomly
flipped / transposed in-plane.

    torchrun --nproc_per_node=4 01_unet3d_mito_fibsem.py --data /groups/em/mito/h5 --out runs/mito_v3
"""
import argparse
import glob
import logging
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
from torch.utils.tensorboard import SummaryWriter

log = logging.getLogger("mito")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--patch", type=int, nargs=3, default=[64, 128, 128])
    p.add_argument("--stride", type=int, nargs=3, default=[48, 96, 96])
    p.add_argument("--batch-size", type=int, default=2, help="per GPU")
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--base-ch", type=int, default=32)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--amp", action="store_true")
    return p.parse_args()


class GridPatchDataset(Dataset):
    """Enumerates all patch origins on a regular grid over every volume."""

    def __init__(self, files, patch, stride, augment=True):
        self.files = files
        self.patch = tuple(patch)
        self.augment = augment
        self.index = []
        for fi, f in enumerate(files):
            with h5py.File(f, "r") as h:
                shape = h["raw"].shape
            ranges = []
            for s, p, st in zip(shape, self.patch, stride):
                starts = list(range(0, max(s - p, 0) + 1, st))
                if starts[-1] != max(s - p, 0):
                    starts.append(max(s - p, 0))
                ranges.append(starts)
            for z in ranges[0]:
                for y in ranges[1]:
                    for x in ranges[2]:
                        self.index.append((fi, z, y, x))
        self._h5 = {}

    def __len__(self):
        return len(self.index)

    def _open(self, fi):
        # keep one handle per worker process
        if fi not in self._h5:
            self._h5[fi] = h5py.File(self.files[fi], "r")
        return self._h5[fi]

    def __getitem__(self, i):
        fi, z, y, x = self.index[i]
        h = self._open(fi)
        dz, dy, dx = self.patch
        raw = h["raw"][z:z + dz, y:y + dy, x:x + dx].astype(np.float32) / 255.0
        lab = h["label"][z:z + dz, y:y + dy, x:x + dx].astype(np.float32)
        if self.augment:
            if np.random.rand() < 0.5:
                raw, lab = raw[:, :, ::-1], lab[:, :, ::-1]
            if np.random.rand() < 0.5:
                raw, lab = raw[:, ::-1], lab[:, ::-1]
            if np.random.rand() < 0.5:
                raw, lab = raw.transpose(0, 2, 1), lab.transpose(0, 2, 1)
            raw = raw * np.random.uniform(0.9, 1.1) + np.random.uniform(-0.05, 0.05)
        raw = (raw - 0.5) / 0.25
        return torch.from_numpy(raw.copy())[None], torch.from_numpy(lab.copy())[None]


def conv_block(cin, cout):
    return nn.Sequential(
        nn.Conv3d(cin, cout, 3, padding=1, bias=False),
        nn.InstanceNorm3d(cout, affine=True),
        nn.LeakyReLU(0.01, inplace=True),
        nn.Conv3d(cout, cout, 3, padding=1, bias=False),
        nn.InstanceNorm3d(cout, affine=True),
        nn.LeakyReLU(0.01, inplace=True),
    )


class UNet3D(nn.Module):
    def __init__(self, base=32, depth=4):
        super().__init__()
        chs = [base * 2 ** i for i in range(depth)]
        self.down = nn.ModuleList()
        cin = 1
        for c in chs:
            self.down.append(conv_block(cin, c))
            cin = c
        # anisotropic pooling: no pooling along z at the first level
        self.pools = [(1, 2, 2)] + [(2, 2, 2)] * (depth - 2)
        self.up = nn.ModuleList()
        self.dec = nn.ModuleList()
        for i in range(depth - 1, 0, -1):
            self.up.append(nn.ConvTranspose3d(chs[i], chs[i - 1], self.pools[i - 1], stride=self.pools[i - 1]))
            self.dec.append(conv_block(2 * chs[i - 1], chs[i - 1]))
        self.head = nn.Conv3d(chs[0], 1, 1)

    def forward(self, x):
        skips = []
        for i, blk in enumerate(self.down):
            x = blk(x)
            if i < len(self.down) - 1:
                skips.append(x)
                x = F.max_pool3d(x, self.pools[i])
        for up, dec in zip(self.up, self.dec):
            x = up(x)
            x = dec(torch.cat([x, skips.pop()], 1))
        return self.head(x)


def dice_bce(logits, target):
    bce = F.binary_cross_entropy_with_logits(logits, target)
    p = torch.sigmoid(logits)
    inter = (p * target).sum()
    dice = 1 - (2 * inter + 1) / (p.sum() + target.sum() + 1)
    return bce + dice


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # inter, pred, gt
    for raw, lab in loader:
        raw, lab = raw.to(device, non_blocking=True), lab.to(device, non_blocking=True)
        pred = (model(raw) > 0).float()
        stats[0] += (pred * lab).sum()
        stats[1] += pred.sum()
        stats[2] += lab.sum()
    dist.all_reduce(stats)
    model.train()
    return (2 * stats[0] / (stats[1] + stats[2]).clamp(min=1)).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    logging.basicConfig(level=logging.INFO if is_main else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(args.seed)
    np.random.seed(args.seed + rank)

    files = sorted(glob.glob(os.path.join(args.data, "*.h5")))
    train_files = [f for f in files if "val" not in os.path.basename(f)]
    val_files = [f for f in files if "val" in os.path.basename(f)]
    train_ds = GridPatchDataset(train_files, args.patch, args.stride)
    val_ds = GridPatchDataset(val_files, args.patch, args.patch, augment=False)
    val_part = Subset(val_ds, list(range(rank, len(val_ds), world)))
    log.info("train patches %d, val patches %d, world %d", len(train_ds), len(val_ds), world)

    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_part, batch_size=args.batch_size, num_workers=2)

    model = UNet3D(args.base_ch).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * world, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    writer = SummaryWriter(args.out) if is_main else None
    if is_main:
        os.makedirs(args.out, exist_ok=True)

    best, step = 0.0, 0
    for epoch in range(args.epochs):
        t0 = time.time()
        running = 0.0
        for raw, lab in train_loader:
            raw, lab = raw.to(device, non_blocking=True), lab.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                loss = dice_bce(model(raw), lab)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            running += loss.item()
            step += 1
            if is_main and step % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
        sched.step()

        dice = evaluate(model, val_loader, device)
        if is_main:
            log.info("epoch %d loss %.4f val dice %.4f (%.0fs)", epoch,
                     running / max(len(train_loader), 1), dice, time.time() - t0)
            writer.add_scalar("val/dice", dice, epoch)
            ckpt = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                    "epoch": epoch, "dice": dice}
            torch.save(ckpt, os.path.join(args.out, "last.pt"))
            if dice > best:
                best = dice
                torch.save(ckpt, os.path.join(args.out, "best.pt"))
        dist.barrier()

    if is_main:
        writer.close()
        log.info("done, best dice %.4f", best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
