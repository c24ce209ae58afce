#!/usr/bin/env python
"""Sentinel-2 land-cover segmentation on pre-cut 256x256 patches.

Patches come from tools/cut_patches.py and are stored as GeoTIFF pairs:
    <root>/<split>/images/<scene>_<row>_<col>.tif   12 bands, uint16 L2A reflectance
    <root>/<split>/labels/<scene>_<row>_<col>.tif   uint8 class ids, 255 = nodata

    torchrun --nproc_per_node=8 01_s2_landcover_unet.py --data-root /mnt/shared/s2lc
"""
import argparse
import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import rasterio
import segmentation_models_pytorch as smp
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

CLASSES = ["water", "trees", "grass", "flooded_veg", "crops",
           "shrub", "built", "bare", "snow", "clouds"]
IGNORE_INDEX = 255

# per-band statistics of the 2021 training scenes (B1..B12 without B10)
S2_MEAN = [1354.4, 1118.2, 1042.9, 947.6, 1199.5, 2003.0,
           2374.0, 2301.2, 732.2, 1820.7, 1118.2, 2599.8]
S2_STD = [245.7, 333.0, 395.1, 593.7, 566.4, 861.2,
          1086.6, 1117.9, 404.9, 1002.6, 761.3, 1231.6]

log = logging.getLogger("s2lc")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", required=True)
    p.add_argument("--out-dir", default="runs/s2lc_unet")
    p.add_argument("--encoder", default="resnet34")
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=16, help="per GPU")
    p.add_argument("--lr", type=float, default=3e-4, help="for a global batch of 128")
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--resume", default="")
    return p.parse_args()


class S2PatchDataset(Dataset):
    def __init__(self, root, split, augment=False):
        self.img_dir = Path(root) / split / "images"
        self.lbl_dir = Path(root) / split / "labels"
        self.names = sorted(p.name for p in self.img_dir.glob("*.tif"))
        self.augment = augment
        self.mean = np.asarray(S2_MEAN, dtype=np.float32)[:, None, None]
        self.std = np.asarray(S2_STD, dtype=np.float32)[:, None, None]

    def __len__(self):
        return len(self.names)

    def __getitem__(self, idx):
        name = self.names[idx]
        with rasterio.open(self.img_dir / name) as src:
            img = src.read().astype(np.float32)
        with rasterio.open(self.lbl_dir / name) as src:
            lbl = src.read(1).astype(np.int64)
        img = (img - self.mean) / self.std
        if self.augment:
            if np.random.rand() < 0.5:
                img, lbl = img[:, :, ::-1], lbl[:, ::-1]
            if np.random.rand() < 0.5:
                img, lbl = img[:, ::-1, :], lbl[::-1, :]
            k = np.random.randint(4)
            img, lbl = np.rot90(img, k, axes=(1, 2)), np.rot90(lbl, k)
        return (torch.from_numpy(np.ascontiguousarray(img)),
                torch.from_numpy(np.ascontiguousarray(lbl)))


class ShardSampler(Sampler):
    """Contiguous, non-padded shard of the dataset for evaluation."""

    def __init__(self, n, rank, world_size):
        per = (n + world_size - 1) // world_size
        self.indices = list(range(rank * per, min(n, (rank + 1) * per)))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


def setup():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return dist.get_rank(), dist.get_world_size(), local_rank


def iou_from_confusion(cm):
    cm = cm.double()
    tp = cm.diag()
    denom = cm.sum(0) + cm.sum(1) - tp
    return torch.where(denom > 0, tp / denom, torch.full_like(tp, float("nan")))


@torch.no_grad()
def evaluate(model, loader, device, num_classes):
    model.eval()
    cm = torch.zeros(num_classes, num_classes, dtype=torch.int64, device=device)
    for img, lbl in loader:
        img = img.to(device, non_blocking=True)
        lbl = lbl.to(device, non_blocking=True)
        pred = model(img).argmax(1)
        valid = lbl != IGNORE_INDEX
        cm += torch.bincount(lbl[valid] * num_classes + pred[valid],
                             minlength=num_classes ** 2).view(num_classes, num_classes)
    dist.all_reduce(cm)
    return iou_from_confusion(cm)


def main():
    args = parse_args()
    rank, world_size, local_rank = setup()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(1234)

    out_dir = Path(args.out_dir)
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        with open(out_dir / "args.json", "w") as f:
            json.dump(vars(args), f, indent=2)
    writer = SummaryWriter(out_dir / "tb") if rank == 0 else None

    train_set = S2PatchDataset(args.data_root, "train", augment=True)
    val_set = S2PatchDataset(args.data_root, "val")
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True,
                              persistent_workers=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size,
                            sampler=ShardSampler(len(val_set), rank, world_size),
                            num_workers=args.workers, pin_memory=True)
    log.info("train patches %d, val patches %d, world size %d",
             len(train_set), len(val_set), world_size)

    num_classes = len(CLASSES)
    model = smp.Unet(args.encoder, encoder_weights=None, in_channels=len(S2_MEAN),
                     classes=num_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)

    lr = args.lr * args.batch_size * world_size / 128
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.weight_decay)
    steps_per_epoch = len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=lr, total_steps=args.epochs * steps_per_epoch, pct_start=0.05)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    start_epoch, best_miou = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_miou = ckpt["epoch"] + 1, ckpt["best_miou"]
        log.info("resumed from %s at epoch %d", args.resume, start_epoch)

    model = DDP(model, device_ids=[local_rank])
    criterion = nn.CrossEntropyLoss(ignore_index=IGNORE_INDEX)

    for epoch in range(start_epoch, args.epochs):
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for step, (img, lbl) in enumerate(train_loader):
            img = img.to(device, non_blocking=True)
            lbl = lbl.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                logits = model(img)
                loss = criterion(logits, lbl)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
            if rank == 0 and step % 50 == 0:
                log.info("epoch %d step %d/%d loss %.4f lr %.2e", epoch, step,
                         steps_per_epoch, loss.item(), scheduler.get_last_lr()[0])

        dist.all_reduce(running)
        train_loss = (running[0] / running[1]).item()
        ious = evaluate(model.module, val_loader, device, num_classes)
        miou = torch.nanmean(ious).item()

        if rank == 0:
            log.info("epoch %d train_loss %.4f mIoU %.4f (%.0fs)", epoch, train_loss,
                     miou, time.time() - t0)
            writer.add_scalar("train/loss", train_loss, epoch)
            writer.add_scalar("val/mIoU", miou, epoch)
            for name, v in zip(CLASSES, ious.tolist()):
                writer.add_scalar(f"val_iou/{name}", v, epoch)
            state = {
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict(),
                "epoch": epoch,
                "best_miou": max(best_miou, miou),
            }
            torch.save(state, out_dir / "last.pth")
            if miou > best_miou:
                torch.save(state, out_dir / "best.pth")
        best_miou = max(best_miou, miou)
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
