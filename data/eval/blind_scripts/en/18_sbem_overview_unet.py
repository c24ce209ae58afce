#!/usr/bin/env python
"""
Nucleus / cell-body segmentation for low-magnification SBEM overview stacks
(used to pick regions for high-res acquisition).

Inputs are HDF5 exports from the SBEM pipeline:  /raw (Z, Y, X) uint8 and
/labels (Z, Y, X) uint8 (0 bg, 1 cell body, 2 nucleus).
Checkpoints go to the group share every epoch so the acquisition PC can pick up
the newest model.

    torchrun --nnodes=1 --nproc_per_node=4 18_sbem_overview_unet.py \
        --train /share/sbem/overview_train.h5 --val /share/sbem/overview_val.h5 \
        --ckpt-dir /share/sbem/models/overview_unet
"""
import argparse
import os
import shutil
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--tile", type=int, default=256)
    p.add_argument("--n-tiles", type=int, default=12000)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


class H5Tiles(Dataset):
    """random tiles from an HDF5 volume; the file is opened once per worker"""

    def __init__(self, path, tile, n, seed=None):
        self.path, self.tile, self.n = path, tile, n
        self.seed = seed
        with h5py.File(path, "r") as f:
            self.shape = f["raw"].shape
        self.f = None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.f is None:
            self.f = h5py.File(self.path, "r")
        rng = np.random.default_rng(self.seed + i) if self.seed is not None else np.random
        Z, H, W = self.shape
        t = self.tile
        z = int(rng.integers(Z)) if self.seed is not None else rng.randint(Z)
        y = int(rng.integers(H - t)) if self.seed is not None else rng.randint(H - t)
        x = int(rng.integers(W - t)) if self.seed is not None else rng.randint(W - t)
        img = self.f["raw"][z, y:y + t, x:x + t].astype(np.float32)
        lab = self.f["labels"][z, y:y + t, x:x + t].astype(np.int64)
        img = (img - img.mean()) / (img.std() + 1e-5)
        if self.seed is None:
            k = np.random.randint(4)
            img, lab = np.rot90(img, k).copy(), np.rot90(lab, k).copy()
        return torch.from_numpy(img)[None], torch.from_numpy(lab)


def double_conv(i, o):
    return nn.Sequential(nn.Conv2d(i, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU(True),
                         nn.Conv2d(o, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU(True))


class UNet(nn.Module):
    def __init__(self, ncls=3, w=(32, 64, 128, 256)):
        super().__init__()
        self.enc = nn.ModuleList([double_conv(1 if i == 0 else w[i - 1], w[i]) for i in range(len(w))])
        self.up = nn.ModuleList([nn.ConvTranspose2d(w[i + 1], w[i], 2, 2) for i in reversed(range(len(w) - 1))])
        self.dec = nn.ModuleList([double_conv(2 * w[i], w[i]) for i in reversed(range(len(w) - 1))])
        self.head = nn.Conv2d(w[0], ncls, 1)

    def forward(self, x):
        s = []
        for i, e in enumerate(self.enc):
            x = e(x if i == 0 else F.max_pool2d(x, 2))
            s.append(x)
        s.pop()
        for u, d in zip(self.up, self.dec):
            x = d(torch.cat([u(x), s.pop()], 1))
        return self.head(x)


def save_checkpoint(state, is_best, ckpt_dir, filename="checkpoint.pth.tar"):
    path = os.path.join(ckpt_dir, filename)
    torch.save(state, path)
    if is_best:
        shutil.copyfile(path, os.path.join(ckpt_dir, "model_best.pth.tar"))


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    os.makedirs(args.ckpt_dir, exist_ok=True)

    train_ds = H5Tiles(args.train, args.tile, args.n_tiles)
    val_ds = H5Tiles(args.val, args.tile, 1024, seed=0)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, args.batch_size, sampler=val_sampler, num_workers=4)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(UNet()).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * world, momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.PolynomialLR(opt, total_iters=args.epochs, power=0.9)

    start_epoch, best_miou = 0, 0.0
    ckpt_path = os.path.join(args.ckpt_dir, "checkpoint.pth.tar")
    if args.resume and os.path.isfile(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ck["state_dict"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        start_epoch, best_miou = ck["epoch"], ck["best_miou"]

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for img, lab in train_dl:
            img, lab = img.to(device, non_blocking=True), lab.to(device, non_blocking=True)
            loss = F.cross_entropy(model(img), lab)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sched.step()

        model.eval()
        inter = torch.zeros(3, device=device)
        union = torch.zeros(3, device=device)
        with torch.no_grad():
            for img, lab in val_dl:
                pred = model.module(img.to(device)).argmax(1)
                lab = lab.to(device)
                for c in range(3):
                    inter[c] += ((pred == c) & (lab == c)).sum()
                    union[c] += ((pred == c) | (lab == c)).sum()
        dist.all_reduce(inter)
        dist.all_reduce(union)
        iou = inter / union.clamp(min=1)
        miou = iou[1:].mean().item()
        is_best = miou > best_miou
        best_miou = max(miou, best_miou)

        if rank == 0:
            print(f"epoch {epoch:2d}  IoU cell {iou[1]:.3f}  nucleus {iou[2]:.3f}  best {best_miou:.3f}"
                  f"  {time.time() - t0:.0f}s", flush=True)
        save_checkpoint({"epoch": epoch + 1, "state_dict": model.module.state_dict(),
                         "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                         "best_miou": best_miou}, is_best, args.ckpt_dir)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
