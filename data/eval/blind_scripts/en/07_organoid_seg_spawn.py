#!/usr/bin/env python
"""
3D organoid / lumen segmentation on light-sheet stacks (single node).

Started as a plain python script on the 4-GPU workstation in room B2.14; the
worker processes are spawned from here, so no torchrun is needed:

    python 07_organoid_seg_spawn.py --data /data/lightsheet/organoids --gpus 4

Stacks are stored as OME-TIFF (C, Z, Y, X) with a labels file next to each
(``*_labels.tif``: 0 bg, 1 organoid, 2 lumen).  Patches 48x160x160.
"""
import argparse
import glob
import os
import random
import socket
import time

import numpy as np
import tifffile
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class OrganoidPatches(Dataset):
    """holds only file names; stacks are memory-mapped inside each worker"""

    def __init__(self, files, patch=(48, 160, 160), n_per_stack=200, augment=True):
        self.files = files
        self.patch = patch
        self.n_per_stack = n_per_stack
        self.augment = augment
        self._open = {}

    def __len__(self):
        return len(self.files) * self.n_per_stack

    def _arrays(self, i):
        if i not in self._open:
            f = self.files[i]
            self._open[i] = (tifffile.memmap(f, mode="r"),
                             tifffile.memmap(f.replace(".ome.tif", "_labels.tif"), mode="r"))
        return self._open[i]

    def __getitem__(self, idx):
        img, lab = self._arrays(idx // self.n_per_stack)
        _, Z, Y, X = img.shape
        pz, py, px = self.patch
        z, y, x = np.random.randint(0, Z - pz + 1), np.random.randint(0, Y - py + 1), np.random.randint(0, X - px + 1)
        im = np.asarray(img[0, z:z + pz, y:y + py, x:x + px], dtype=np.float32)
        lb = np.asarray(lab[z:z + pz, y:y + py, x:x + px], dtype=np.int64)
        lo, hi = np.percentile(im, (2, 99.9))
        im = (im - lo) / max(hi - lo, 1.0)
        if self.augment:
            for ax in (1, 2):
                if np.random.rand() < 0.5:
                    im, lb = np.flip(im, ax), np.flip(lb, ax)
            im = im + np.random.normal(0, 0.02, im.shape).astype(np.float32)
        return torch.from_numpy(im.copy())[None], torch.from_numpy(lb.copy())


def seed_worker(worker_id):
    s = torch.initial_seed() % 2 ** 32
    np.random.seed(s)
    random.seed(s)


def conv3(cin, cout):
    return nn.Sequential(nn.Conv3d(cin, cout, 3, padding=1, bias=False), nn.GroupNorm(8, cout), nn.ReLU(True),
                         nn.Conv3d(cout, cout, 3, padding=1, bias=False), nn.GroupNorm(8, cout), nn.ReLU(True))


class UNet3D(nn.Module):
    def __init__(self, ncls=3, w=(16, 32, 64, 128)):
        super().__init__()
        self.enc = nn.ModuleList([conv3(1 if i == 0 else w[i - 1], w[i]) for i in range(len(w))])
        self.ups = nn.ModuleList([nn.ConvTranspose3d(w[i + 1], w[i], 2, 2) for i in reversed(range(len(w) - 1))])
        self.dec = nn.ModuleList([conv3(2 * w[i], w[i]) for i in reversed(range(len(w) - 1))])
        self.head = nn.Conv3d(w[0], ncls, 1)

    def forward(self, x):
        skips = []
        for i, e in enumerate(self.enc):
            x = e(x if i == 0 else F.max_pool3d(x, 2))
            skips.append(x)
        skips.pop()
        for up, d in zip(self.ups, self.dec):
            x = d(torch.cat([up(x), skips.pop()], 1))
        return self.head(x)


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    dev = torch.device("cuda", rank)
    # same seed for model init / split on all ranks; augmentation randomness
    # differs per rank through the DataLoader generator below
    torch.manual_seed(args.seed)

    files = sorted(glob.glob(os.path.join(args.data, "*.ome.tif")))
    split_rng = random.Random(args.seed)
    split_rng.shuffle(files)
    n_val = max(1, int(0.15 * len(files)))
    train_files, val_files = files[n_val:], files[:n_val]

    train_ds = OrganoidPatches(train_files, n_per_stack=args.patches_per_stack)
    val_ds = OrganoidPatches(val_files, n_per_stack=32, augment=False)
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_ds, num_replicas=world_size, rank=rank, shuffle=False, drop_last=True)
    g = torch.Generator()
    g.manual_seed(args.seed + rank)
    train_dl = DataLoader(train_ds, batch_size=args.batch, sampler=sampler, num_workers=args.workers,
                          worker_init_fn=seed_worker, generator=g, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch, sampler=val_sampler, num_workers=2,
                        worker_init_fn=seed_worker)

    model = DDP(UNet3D().to(dev), device_ids=[rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * world_size, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.PolynomialLR(opt, total_iters=args.epochs, power=0.9)
    weights = torch.tensor([0.5, 1.0, 2.0], device=dev)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=dev)
        for im, lb in train_dl:
            im, lb = im.to(dev, non_blocking=True), lb.to(dev, non_blocking=True)
            loss = F.cross_entropy(model(im), lb, weight=weights)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            run += torch.stack([loss.detach(), torch.ones((), device=dev)])
        sched.step()

        model.eval()
        conf = torch.zeros(3, 3, device=dev, dtype=torch.long)
        with torch.no_grad():
            for im, lb in val_dl:
                pred = model.module(im.to(dev)).argmax(1)
                lb = lb.to(dev)
                conf += torch.bincount(lb.flatten() * 3 + pred.flatten(), minlength=9).view(3, 3)
        dist.all_reduce(conf)
        dist.all_reduce(run)
        iou = conf.diag().float() / (conf.sum(0) + conf.sum(1) - conf.diag()).clamp(min=1).float()

        if rank == 0:
            print(f"epoch {epoch:3d}  loss {(run[0] / run[1]).item():.4f}  IoU organoid {iou[1]:.3f} lumen {iou[2]:.3f}"
                  f"  {time.time() - t0:.0f}s", flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "iou": iou.tolist()},
                       os.path.join(args.out, f"organoid_unet3d_e{epoch:03d}.pt"))

    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/organoids")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--patches-per-stack", type=int, default=200)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()

    world_size = min(args.gpus, torch.cuda.device_count())
    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(worker, args=(world_size, args), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
