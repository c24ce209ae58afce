#!/usr/bin/env python
"""Land-cover segmentation on Sentinel-2 L2A scenes (ESA WorldCover labels).

The scenes are large (10980 x 10980 px at 10 m), so they are cut into fixed-size
patches once; the patch index is cached next to the data so later runs start
immediately. Validation runs on whole scenes with an overlapping sliding window.

    torchrun --nproc_per_node=8 11_landcover_unet_accum.py --data-root /data/s2_worldcover
"""
import argparse
import contextlib
import datetime
import json
import logging
import math
import os
import time
from pathlib import Path

import numpy as np
import rasterio
import segmentation_models_pytorch as smp
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from rasterio.windows import Window
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

S2_BANDS = ["B02", "B03", "B04", "B05", "B06", "B07", "B08", "B8A", "B11", "B12"]
BAND_MEAN = [1354.4, 1118.2, 1042.9, 947.6, 1199.5, 1999.8, 2369.2, 2296.8, 2114.4, 1445.0]
BAND_STD = [245.7, 333.0, 395.1, 593.7, 566.4, 861.2, 1086.6, 1117.9, 1013.5, 865.7]
NUM_CLASSES = 11
IGNORE_INDEX = 255

logger = logging.getLogger("landcover")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", type=Path, required=True)
    p.add_argument("--out-dir", type=Path, default=Path("runs/landcover_unet"))
    p.add_argument("--patch", type=int, default=256)
    p.add_argument("--stride", type=int, default=224)
    p.add_argument("--min-valid", type=float, default=0.5)
    p.add_argument("--batch-size", type=int, default=16, help="per GPU")
    p.add_argument("--accum-steps", type=int, default=2)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--val-overlap", type=int, default=64)
    p.add_argument("--encoder", default="resnet50")
    return p.parse_args()


def build_patch_index(scene_dir, patch, stride, min_valid):
    index = []
    for img_path in sorted(scene_dir.glob("*_S2.tif")):
        lab_path = img_path.with_name(img_path.name.replace("_S2.tif", "_LC.tif"))
        with rasterio.open(lab_path) as src:
            lab = src.read(1)
        h, w = lab.shape
        for y in range(0, h - patch + 1, stride):
            for x in range(0, w - patch + 1, stride):
                valid = (lab[y:y + patch, x:x + patch] != IGNORE_INDEX).mean()
                if valid >= min_valid:
                    index.append({"image": str(img_path), "label": str(lab_path), "y": y, "x": x})
    return index


def load_or_build_index(root, split, patch, stride, min_valid, rank):
    cache = root / f"patch_index_{split}_{patch}_{stride}.json"
    if rank == 0 and not cache.exists():
        t0 = time.time()
        index = build_patch_index(root / split, patch, stride, min_valid)
        tmp = cache.with_suffix(".json.tmp")
        with open(tmp, "w") as f:
            json.dump(index, f)
        os.replace(tmp, cache)
        logger.info("built %s index: %d patches in %.0fs", split, len(index), time.time() - t0)
    dist.barrier()
    with open(cache) as f:
        return json.load(f)


class PatchDataset(Dataset):
    def __init__(self, index, patch, augment):
        self.index = index
        self.patch = patch
        self.augment = augment
        self.mean = np.array(BAND_MEAN, dtype=np.float32)[:, None, None]
        self.std = np.array(BAND_STD, dtype=np.float32)[:, None, None]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        rec = self.index[i]
        win = Window(rec["x"], rec["y"], self.patch, self.patch)
        with rasterio.open(rec["image"]) as src:
            img = src.read(window=win).astype(np.float32)
        with rasterio.open(rec["label"]) as src:
            lab = src.read(1, window=win).astype(np.int64)
        img = (img - self.mean) / self.std
        if self.augment:
            k = np.random.randint(4)
            img, lab = np.rot90(img, k, axes=(1, 2)), np.rot90(lab, k)
            if np.random.rand() < 0.5:
                img, lab = img[:, :, ::-1], lab[:, ::-1]
        return torch.from_numpy(img.copy()), torch.from_numpy(lab.copy())


def sliding_window_predict(net, img, patch, overlap, num_classes):
    """img: (C, H, W) on the GPU. Returns (num_classes, H, W) averaged logits."""
    _, h, w = img.shape
    stride = patch - overlap
    logits = torch.zeros(num_classes, h, w, device=img.device)
    counts = torch.zeros(1, h, w, device=img.device)
    ys = list(range(0, max(h - patch, 0) + 1, stride))
    xs = list(range(0, max(w - patch, 0) + 1, stride))
    if ys[-1] + patch < h:
        ys.append(h - patch)
    if xs[-1] + patch < w:
        xs.append(w - patch)
    for y in ys:
        crops = torch.stack([img[:, y:y + patch, x:x + patch] for x in xs])
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = net(crops).float()
        for j, x in enumerate(xs):
            logits[:, y:y + patch, x:x + patch] += out[j]
            counts[:, y:y + patch, x:x + patch] += 1
    return logits / counts


@torch.no_grad()
def evaluate(model, scenes, args, device, rank, world_size):
    net = model.module
    net.eval()
    conf = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.int64, device=device)
    mean = torch.tensor(BAND_MEAN, device=device)[:, None, None]
    std = torch.tensor(BAND_STD, device=device)[:, None, None]
    # whole scenes are split across ranks; counts per rank may differ by one
    for img_path, lab_path in scenes[rank::world_size]:
        with rasterio.open(img_path) as src:
            img = torch.from_numpy(src.read().astype(np.float32)).to(device)
        with rasterio.open(lab_path) as src:
            lab = torch.from_numpy(src.read(1).astype(np.int64)).to(device)
        img = (img - mean) / std
        pred = sliding_window_predict(net, img, args.patch, args.val_overlap, NUM_CLASSES).argmax(0)
        keep = lab != IGNORE_INDEX
        idx = lab[keep] * NUM_CLASSES + pred[keep]
        conf += torch.bincount(idx, minlength=NUM_CLASSES ** 2).view(NUM_CLASSES, NUM_CLASSES)
    dist.all_reduce(conf)
    inter = conf.diag().float()
    union = conf.sum(0).float() + conf.sum(1).float() - inter
    iou = inter / union.clamp(min=1)
    net.train()
    return iou.mean().item(), iou.cpu().tolist()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # the first run builds the patch index on rank 0 while the others wait in the barrier
    dist.init_process_group(backend="nccl", timeout=datetime.timedelta(minutes=90))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(asctime)s %(message)s")
    torch.manual_seed(1234)

    train_index = load_or_build_index(args.data_root, "train", args.patch, args.stride, args.min_valid, rank)
    train_set = PatchDataset(train_index, args.patch, augment=True)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.workers, pin_memory=True, drop_last=True,
                        persistent_workers=True)
    val_scenes = [(str(p), str(p).replace("_S2.tif", "_LC.tif"))
                  for p in sorted((args.data_root / "val").glob("*_S2.tif"))]

    model = smp.Unet(args.encoder, encoder_weights=None, in_channels=len(S2_BANDS), classes=NUM_CLASSES)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    steps_per_epoch = len(loader) // args.accum_steps
    total = args.epochs * steps_per_epoch
    warmup = 2 * steps_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    criterion = nn.CrossEntropyLoss(ignore_index=IGNORE_INDEX)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    writer = SummaryWriter(args.out_dir / "tb") if rank == 0 else None
    best_miou, step = 0.0, 0

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        running = torch.zeros(2, device=device)
        t0 = time.time()
        for i, (img, lab) in enumerate(loader):
            img = img.to(device, non_blocking=True)
            lab = lab.to(device, non_blocking=True)
            sync_now = (i + 1) % args.accum_steps == 0
            ctx = contextlib.nullcontext() if sync_now else model.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = criterion(model(img), lab)
                (loss / args.accum_steps).backward()
            running += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if sync_now:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                step += 1
        dist.all_reduce(running)
        train_loss = (running[0] / running[1]).item()

        miou, per_class = evaluate(model, val_scenes, args, device, rank, world_size)
        if rank == 0:
            logger.info("epoch %d loss %.4f mIoU %.4f (%.0fs)", epoch, train_loss, miou, time.time() - t0)
            writer.add_scalar("train/loss", train_loss, epoch)
            writer.add_scalar("val/mIoU", miou, epoch)
            for c, v in enumerate(per_class):
                writer.add_scalar(f"val/iou_{c}", v, epoch)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch, "miou": miou}
            torch.save(state, args.out_dir / "last.pth")
            if miou > best_miou:
                best_miou = miou
                torch.save(state, args.out_dir / "best.pth")

    if rank == 0:
        writer.close()
        logger.info("best mIoU %.4f", best_miou)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
