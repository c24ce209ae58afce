#!/usr/bin/env python3
# SpaceNet-style building footprint segmentation (RGB+NIR 0.3 m, 4-band GeoTIFF chips)
#
#   torchrun --nproc_per_node=4 04_building_footprint_deeplab.py \
#       --chips /shared/spacenet7/chips --resume /shared/runs/bfp_deeplab/ckpt_latest.pth
#
# Chips: <chips>/{train,val}/img/*.tif with matching <chips>/{train,val}/mask/*.tif
import argparse
import os
import sys
import time
from glob import glob

import numpy as np
import rasterio
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

BAND_MEAN = np.array([86.4, 93.1, 79.8, 112.6], dtype=np.float32)
BAND_STD = np.array([41.2, 36.7, 34.9, 48.3], dtype=np.float32)


def get_parser():
    parser = argparse.ArgumentParser("building footprints")
    parser.add_argument("--chips", type=str, required=True)
    parser.add_argument("--output", type=str, default="/shared/runs/bfp_deeplab")
    parser.add_argument("--epochs", type=int, default=80)
    parser.add_argument("--batch-size", type=int, default=12)
    parser.add_argument("--base-lr", type=float, default=0.01)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--wd", type=float, default=1e-4)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--resume", type=str, default="")
    parser.add_argument("--save-every", type=int, default=5)
    return parser


class FootprintChips(Dataset):
    def __init__(self, root, split, train):
        self.images = sorted(glob(os.path.join(root, split, "img", "*.tif")))
        self.masks = [p.replace(os.sep + "img" + os.sep, os.sep + "mask" + os.sep) for p in self.images]
        self.train = train

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        with rasterio.open(self.images[i]) as src:
            x = src.read([1, 2, 3, 4]).astype(np.float32)
        with rasterio.open(self.masks[i]) as src:
            y = (src.read(1) > 0).astype(np.float32)
        x = (x - BAND_MEAN[:, None, None]) / BAND_STD[:, None, None]
        if self.train:
            if np.random.random() < 0.5:
                x, y = x[:, :, ::-1], y[:, ::-1]
            if np.random.random() < 0.5:
                x, y = x[:, ::-1, :], y[::-1, :]
            if np.random.random() < 0.5:
                x, y = x.transpose(0, 2, 1), y.T
        return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(y))


def build_model():
    model = torchvision.models.segmentation.deeplabv3_resnet50(weights=None, weights_backbone=None,
                                                              num_classes=1, aux_loss=False)
    old = model.backbone.conv1
    model.backbone.conv1 = nn.Conv2d(4, old.out_channels, kernel_size=old.kernel_size,
                                     stride=old.stride, padding=old.padding, bias=False)
    return model


def dice_bce(logits, target, eps=1.0):
    bce = F.binary_cross_entropy_with_logits(logits, target)
    p = torch.sigmoid(logits)
    inter = (p * target).sum((1, 2))
    dice = 1 - (2 * inter + eps) / (p.sum((1, 2)) + target.sum((1, 2)) + eps)
    return bce + dice.mean()


def is_main():
    return dist.get_rank() == 0


def log(msg):
    if is_main():
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def save_checkpoint(path, model, optimizer, scheduler, epoch, best_iou):
    if not is_main():
        return
    tmp = path + ".tmp"
    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "epoch": epoch, "best_iou": best_iou}, tmp)
    os.replace(tmp, path)


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    counts = torch.zeros(3, device=device, dtype=torch.float64)  # intersection, union, pixels
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        pred = (model(x)["out"][:, 0] > 0).float()
        counts[0] += (pred * y).sum()
        counts[1] += ((pred + y) > 0).sum()
        counts[2] += y.numel()
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    return (counts[0] / counts[1].clamp(min=1)).item()


def main(argv):
    args = get_parser().parse_args(argv)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    world_size = dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    train_ds = FootprintChips(args.chips, "train", train=True)
    val_ds = FootprintChips(args.chips, "val", train=False)
    # val chips are checked to be a multiple of the world size by tools/make_chips.py
    assert len(val_ds) % world_size == 0, f"{len(val_ds)} val chips not divisible by {world_size}"
    train_sampler = DistributedSampler(train_ds)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    model = build_model()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank], output_device=local_rank)

    # linear scaling rule, base lr is for 8 images / step
    lr = args.base_lr * args.batch_size * world_size / 8
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum,
                                weight_decay=args.wd)
    total_iters = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda it: (1 - it / total_iters) ** 0.9)

    start_epoch, best_iou = 0, 0.0
    if args.resume and os.path.isfile(args.resume):
        checkpoint = torch.load(args.resume)
        model.module.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        start_epoch = checkpoint["epoch"] + 1
        best_iou = checkpoint["best_iou"]
        log(f"resumed {args.resume} (epoch {checkpoint['epoch']}, best IoU {best_iou:.4f})")

    if is_main():
        os.makedirs(args.output, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        loss_meter = torch.zeros(2, device=device)
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            out = model(x)["out"][:, 0]
            loss = dice_bce(out, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            loss_meter[0] += loss.detach()
            loss_meter[1] += 1
            if i % 50 == 0:
                log(f"epoch {epoch} iter {i}/{len(train_loader)} loss {loss.item():.4f}")
        dist.all_reduce(loss_meter)
        val_iou = validate(model, val_loader, device)
        log(f"epoch {epoch} done in {time.time() - tic:.0f}s, "
            f"train loss {(loss_meter[0] / loss_meter[1]).item():.4f}, val IoU {val_iou:.4f}")

        if val_iou > best_iou:
            best_iou = val_iou
            save_checkpoint(os.path.join(args.output, "ckpt_best.pth"), model, optimizer,
                            scheduler, epoch, best_iou)
        if (epoch + 1) % args.save_every == 0 or epoch + 1 == args.epochs:
            save_checkpoint(os.path.join(args.output, "ckpt_latest.pth"), model, optimizer,
                            scheduler, epoch, best_iou)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
