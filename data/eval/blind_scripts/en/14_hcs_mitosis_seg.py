#!/usr/bin/env python
"""
Semantic segmentation of widefield fluorescence screens (HCS plates, Opera
Phenix export): background / cell / mitotic cell.

Each field of view is a (C, Y, X) TIFF (Hoechst, tubulin, pH3) with a label
PNG next to it.  Fields are split into train / val by *field*, then cut into
256x256 tiles (per-tile, per-channel percentile normalisation).

    torchrun --nproc_per_node=4 14_hcs_mitosis_seg.py --plate-dir /data/hcs/plate_2023_11_07 \
        --out /data/hcs/models/mitosis_seg
"""
import argparse
import glob
import os
import random
import time

import imageio.v3 as iio
import numpy as np
import tifffile
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--plate-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tile", type=int, default=256)
    ap.add_argument("--val-fraction", type=float, default=0.15)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=2023)
    return ap.parse_args()


def split_fields(fields, val_fraction):
    fields = list(fields)
    random.shuffle(fields)
    n_val = max(1, int(round(val_fraction * len(fields))))
    return fields[n_val:], fields[:n_val]


class FieldTiles(Dataset):
    def __init__(self, fields, tile, augment):
        self.tile = tile
        self.augment = augment
        self.items = []
        for f in fields:
            H, W = tifffile.TiffFile(f).series[0].shape[-2:]
            for y in range(0, H - tile + 1, tile):
                for x in range(0, W - tile + 1, tile):
                    self.items.append((f, y, x))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        f, y, x = self.items[i]
        t = self.tile
        img = tifffile.imread(f)[:, y:y + t, x:x + t].astype(np.float32)
        lab = iio.imread(f.replace(".tif", "_labels.png"))[y:y + t, x:x + t].astype(np.int64)
        for c in range(img.shape[0]):
            lo, hi = np.percentile(img[c], (1, 99.5))
            img[c] = (img[c] - lo) / max(hi - lo, 1e-3)
        if self.augment:
            if np.random.rand() < 0.5:
                img, lab = img[:, :, ::-1], lab[:, ::-1]
            if np.random.rand() < 0.5:
                img, lab = img[:, ::-1], lab[::-1]
            img = img * np.random.uniform(0.9, 1.1, (img.shape[0], 1, 1)).astype(np.float32)
        return torch.from_numpy(np.ascontiguousarray(img)), torch.from_numpy(np.ascontiguousarray(lab))


def dconv(i, o):
    return nn.Sequential(nn.Conv2d(i, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU(True),
                         nn.Conv2d(o, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU(True))


class UNet(nn.Module):
    def __init__(self, cin=3, ncls=3, w=(32, 64, 128, 256)):
        super().__init__()
        self.down = nn.ModuleList([dconv(cin if i == 0 else w[i - 1], w[i]) for i in range(len(w))])
        self.up = nn.ModuleList([nn.ConvTranspose2d(w[i + 1], w[i], 2, 2) for i in reversed(range(len(w) - 1))])
        self.dec = nn.ModuleList([dconv(2 * w[i], w[i]) for i in reversed(range(len(w) - 1))])
        self.cls = nn.Conv2d(w[0], ncls, 1)

    def forward(self, x):
        s = []
        for i, d in enumerate(self.down):
            x = d(x if i == 0 else F.max_pool2d(x, 2))
            s.append(x)
        s.pop()
        for u, d in zip(self.up, self.dec):
            x = d(torch.cat([u(x), s.pop()], 1))
        return self.cls(x)


def confusion(pred, lab, n=3):
    return torch.bincount((lab * n + pred).flatten(), minlength=n * n).view(n, n)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # different augmentation stream on every GPU
    seed_everything(args.seed + rank)

    fields = sorted(f for f in glob.glob(os.path.join(args.plate_dir, "*.tif")) if "_labels" not in f)
    train_fields, val_fields = split_fields(fields, args.val_fraction)
    train_ds = FieldTiles(train_fields, args.tile, augment=True)
    val_ds = FieldTiles(val_fields, args.tile, augment=False)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                          num_workers=args.workers, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler, num_workers=args.workers)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(UNet()).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * world, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr * world,
                                                total_steps=args.epochs * len(train_dl))
    class_w = torch.tensor([0.3, 1.0, 4.0], device=device)  # mitotic cells are rare

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(train_fields)} train / {len(val_fields)} val fields, "
              f"{len(train_ds)} train tiles", flush=True)

    best_miou = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for img, lab in train_dl:
            img, lab = img.to(device, non_blocking=True), lab.to(device, non_blocking=True)
            loss = F.cross_entropy(model(img), lab, weight=class_w)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()

        model.eval()
        conf = torch.zeros(3, 3, dtype=torch.long, device=device)
        with torch.no_grad():
            for img, lab in val_dl:
                img, lab = img.to(device), lab.to(device)
                conf += confusion(model.module(img).argmax(1), lab)
        dist.all_reduce(conf)
        iou = conf.diag().float() / (conf.sum(0) + conf.sum(1) - conf.diag()).clamp(min=1).float()
        miou = iou.mean().item()

        if rank == 0:
            print(f"epoch {epoch:2d}  mIoU {miou:.4f}  (bg {iou[0]:.3f} cell {iou[1]:.3f} mitotic {iou[2]:.3f})"
                  f"  {time.time() - t0:.0f}s", flush=True)
            if miou > best_miou:
                best_miou = miou
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "miou": miou,
                            "val_fields": val_fields}, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
