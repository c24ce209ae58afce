"""
Building segmentation on municipal orthophoto mosaics (4-band RGBI GeoTIFF, 20 cm).
The mosaics are irregular (municipality boundaries), so random windows can land
partly or fully outside the footprint; the label raster marks those pixels as 255.

    torchrun --nproc_per_node=4 train_ortho_buildings.py --tiles /data/ortho/tiles.txt --crop 640
"""
import argparse
import math
import os
import time

import numpy as np
import rasterio
from rasterio.windows import Window
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
import segmentation_models_pytorch as smp

IGNORE = 255


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiles", required=True, help="txt: image_path label_path split per line")
    ap.add_argument("--crop", type=int, default=640)
    ap.add_argument("--crops-per-tile", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--out", default="runs/ortho_buildings")
    return ap.parse_args()


def read_tiles(list_file):
    train, val = [], []
    with open(list_file) as f:
        for line in f:
            img, lab, split = line.split()
            (train if split == "train" else val).append((img, lab))
    return train, val


class RandomWindows(Dataset):
    """Each item is a random crop from one of the mosaic tiles (crops_per_tile virtual items per tile)."""

    def __init__(self, tiles, crop, crops_per_tile, stats):
        self.tiles = tiles
        self.crop = crop
        self.k = crops_per_tile
        self.mean = np.asarray(stats[0], np.float32)[:, None, None]
        self.std = np.asarray(stats[1], np.float32)[:, None, None]
        self.shapes = []
        for img, _ in tiles:
            with rasterio.open(img) as src:
                self.shapes.append((src.height, src.width))

    def __len__(self):
        return len(self.tiles) * self.k

    def __getitem__(self, i):
        t = i // self.k
        img_path, lab_path = self.tiles[t]
        H, W = self.shapes[t]
        y = np.random.randint(0, H - self.crop + 1)
        x = np.random.randint(0, W - self.crop + 1)
        win = Window(x, y, self.crop, self.crop)
        with rasterio.open(img_path) as src:
            img = src.read(window=win).astype(np.float32)
        with rasterio.open(lab_path) as src:
            lab = src.read(1, window=win).astype(np.int64)
        img = (img - self.mean) / self.std
        if np.random.rand() < 0.5:
            img, lab = img[:, :, ::-1], lab[:, ::-1]
        k = np.random.randint(4)
        img, lab = np.rot90(img, k, (1, 2)), np.rot90(lab, k)
        return torch.from_numpy(img.copy()), torch.from_numpy(lab.copy())


class GridWindows(Dataset):
    def __init__(self, tiles, crop, stats):
        self.items = []
        self.mean = np.asarray(stats[0], np.float32)[:, None, None]
        self.std = np.asarray(stats[1], np.float32)[:, None, None]
        self.crop = crop
        for img, lab in tiles:
            with rasterio.open(img) as src:
                H, W = src.height, src.width
            for y in range(0, H - crop + 1, crop):
                for x in range(0, W - crop + 1, crop):
                    self.items.append((img, lab, x, y))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        img_path, lab_path, x, y = self.items[i]
        win = Window(x, y, self.crop, self.crop)
        with rasterio.open(img_path) as src:
            img = src.read(window=win).astype(np.float32)
        with rasterio.open(lab_path) as src:
            lab = src.read(1, window=win).astype(np.int64)
        return torch.from_numpy((img - self.mean) / self.std), torch.from_numpy(lab)


def bce_dice_loss(logits, lab):
    valid = lab != IGNORE
    target = (lab == 1).float()
    bce = F.binary_cross_entropy_with_logits(logits[:, 0][valid], target[valid])
    p = torch.sigmoid(logits[:, 0]) * valid
    t = target * valid
    dice = 1 - (2 * (p * t).sum() + 1) / (p.sum() + t.sum() + 1)
    return bce + dice


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    np.random.seed(1000 + rank)

    train_tiles, val_tiles = read_tiles(args.tiles)
    stats = ([112.4, 118.9, 109.3, 131.2], [48.1, 44.7, 42.5, 51.9])  # RGBI, from the 2021 mosaic
    train_ds = RandomWindows(train_tiles, args.crop, args.crops_per_tile, stats)
    val_ds = GridWindows(val_tiles, args.crop, stats)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, args.batch_size, sampler=DistributedSampler(val_ds, shuffle=False),
                        num_workers=args.workers)

    model = smp.Unet("resnet50", encoder_weights=None, in_channels=4, classes=1)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_dl))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_iou = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, seen, skipped = time.time(), 0, 0
        for img, lab in train_dl:
            img, lab = img.to(device, non_blocking=True), lab.to(device, non_blocking=True)
            if (lab != IGNORE).float().mean() < 0.05:
                # window is (almost) entirely outside the mosaic footprint
                skipped += 1
                continue
            logits = model(img)
            loss = bce_dice_loss(logits, lab)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            seen += img.shape[0]

        model.eval()
        inter_union = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for img, lab in val_dl:
                img, lab = img.to(device), lab.to(device)
                pred = model(img)[:, 0] > 0
                valid = lab != IGNORE
                gt = lab == 1
                inter_union[0] += (pred & gt & valid).sum()
                inter_union[1] += ((pred | gt) & valid).sum()
        dist.all_reduce(inter_union)
        iou = (inter_union[0] / inter_union[1].clamp(min=1)).item()
        if rank == 0:
            print(f"epoch {epoch:02d} samples {seen} skipped {skipped} batches, val IoU {iou:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if iou > best_iou:
                best_iou = iou
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
