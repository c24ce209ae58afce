#!/usr/bin/env python
"""EnMAP hyperspectral land-cover segmentation (spectral-spatial network).

Tiles: 128x128 px, 202 usable bands after removing water-vapour absorption
bands, stored as int16 GeoTIFF (reflectance x 10000) with an ESA WorldCover
derived label raster (11 classes, 0 = nodata).

Launch:
    torchrun --nproc_per_node=4 19_hyperspectral_pixel_seg.py \
        --tiles /data/shared/enmap/tiles --epochs 60
"""
import argparse
import json
import os
import time

import numpy as np
import rasterio
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

WORLDCOVER = [10, 20, 30, 40, 50, 60, 70, 80, 90, 95, 100]
WC_LUT = np.full(256, 255, np.uint8)
for i, code in enumerate(WORLDCOVER):
    WC_LUT[code] = i


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiles", required=True)
    parser.add_argument("--output", default="/data/shared/enmap/runs/ssnet")
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--spectral-dim", type=int, default=64)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


class EnMAPTiles(Dataset):
    def __init__(self, root, split, band_stats, augment=False):
        with open(os.path.join(root, f"{split}.txt")) as f:
            self.ids = [l.strip() for l in f if l.strip()]
        self.root, self.augment = root, augment
        self.mean = np.asarray(band_stats["mean"], np.float32)[:, None, None]
        self.std = np.asarray(band_stats["std"], np.float32)[:, None, None]
        self.bands = band_stats["keep_bands"]       # 1-based indices of usable bands

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        tid = self.ids[i]
        with rasterio.open(os.path.join(self.root, "img", f"{tid}.tif")) as src:
            x = src.read(self.bands).astype(np.float32)
        with rasterio.open(os.path.join(self.root, "lbl", f"{tid}.tif")) as src:
            y = WC_LUT[src.read(1)].astype(np.int64)
        x = (x - self.mean) / self.std
        if self.augment:
            if np.random.rand() < 0.5:
                x, y = x[:, :, ::-1], y[:, ::-1]
            if np.random.rand() < 0.5:
                x, y = x[:, ::-1, :], y[::-1, :]
            x = x + np.random.normal(0, 0.01, size=(x.shape[0], 1, 1)).astype(np.float32)
        return torch.from_numpy(x.copy()), torch.from_numpy(y.copy())


class SpectralSpatialNet(nn.Module):
    """1x1 spectral compression followed by a small residual spatial encoder-decoder."""

    def __init__(self, n_bands, n_classes, spectral_dim=64):
        super().__init__()
        self.spectral = nn.Sequential(
            nn.Conv2d(n_bands, 128, 1), nn.BatchNorm2d(128), nn.GELU(),
            nn.Conv2d(128, spectral_dim, 1), nn.BatchNorm2d(spectral_dim), nn.GELU())
        self.down1 = self._block(spectral_dim, 96, stride=1)
        self.down2 = self._block(96, 192, stride=2)
        self.down3 = self._block(192, 256, stride=2)
        self.up2 = nn.Sequential(nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False),
                                 self._block(256, 192, 1))
        self.up1 = nn.Sequential(nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False),
                                 self._block(192 * 2, 96, 1))
        self.head = nn.Conv2d(96 * 2, n_classes, 1)

    @staticmethod
    def _block(cin, cout, stride):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
                             nn.BatchNorm2d(cout), nn.GELU(),
                             nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.GELU())

    def forward(self, x):
        s = self.spectral(x)
        d1 = self.down1(s)
        d2 = self.down2(d1)
        d3 = self.down3(d2)
        u2 = self.up2(d3)
        u1 = self.up1(torch.cat([u2, d2], 1))
        return self.head(torch.cat([u1, d1], 1))


@torch.no_grad()
def evaluate(net, loader, n_classes, device):
    net.eval()
    cm = torch.zeros(n_classes, n_classes, dtype=torch.int64, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        p = net(x).argmax(1)
        k = y != 255
        cm += torch.bincount(y[k] * n_classes + p[k], minlength=n_classes ** 2).view(n_classes, n_classes)
    dist.all_reduce(cm)
    cm = cm.double()
    iou = cm.diag() / (cm.sum(0) + cm.sum(1) - cm.diag()).clamp(min=1)
    present = cm.sum(1) > 0
    return iou, iou[present].mean().item(), (cm.diag().sum() / cm.sum().clamp(min=1)).item()


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    torch.manual_seed(0)
    np.random.seed(rank)

    with open(os.path.join(args.tiles, "band_stats.json")) as f:
        band_stats = json.load(f)
    n_bands, n_classes = len(band_stats["keep_bands"]), len(WORLDCOVER)
    train_ds = EnMAPTiles(args.tiles, "train", band_stats, augment=True)
    val_ds = EnMAPTiles(args.tiles, "val", band_stats)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                          num_workers=args.workers, pin_memory=True, drop_last=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world_size)),
                        batch_size=args.batch_size, num_workers=args.workers, pin_memory=True)

    net = SpectralSpatialNet(n_bands, n_classes, args.spectral_dim)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[args.local_rank], output_device=args.local_rank)

    lr = args.lr * world_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.02)
    warmup_steps = 2 * len(train_dl)
    total_steps = args.epochs * len(train_dl)
    scheduler = torch.optim.lr_scheduler.SequentialLR(
        optimizer,
        [torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=warmup_steps),
         torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps - warmup_steps)],
        milestones=[warmup_steps])
    criterion = nn.CrossEntropyLoss(ignore_index=255, label_smoothing=0.1)

    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        print(f"{n_bands} bands, {len(train_ds)} train tiles, {len(val_ds)} val tiles, world {world_size}",
              flush=True)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(x)
            loss = criterion(out.float(), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            optimizer.step()
            scheduler.step()
            if rank == 0 and step % 100 == 0:
                print(f"ep {epoch} step {step}/{len(train_dl)} loss {loss.item():.4f}", flush=True)

        iou, miou, oa = evaluate(net, val_dl, n_classes, device)
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s) mIoU {miou:.4f} OA {oa:.4f} | "
                  + " ".join(f"{c}:{v:.2f}" for c, v in zip(WORLDCOVER, iou.tolist())), flush=True)
            torch.save({"epoch": epoch, "model": net.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "band_stats": band_stats},
                       os.path.join(args.output, "last.pt"))
            if miou > best:
                best = miou
                torch.save(net.state_dict(), os.path.join(args.output, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
