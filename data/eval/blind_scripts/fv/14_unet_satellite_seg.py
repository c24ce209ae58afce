"""Building footprint segmentation (U-Net, ResNet-34 encoder) on 512x512 tiles.

This was an apex job (apex.parallel.convert_syncbn_model, apex DDP,
amp O1) started with `python -m torch.distributed.launch`. It now uses native
SyncBatchNorm / DDP / autocast and is started with torchrun.
"""
import argparse
import glob
import os
import time

import albumentations as A
import cv2
import numpy as np
import segmentation_models_pytorch as smp
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from albumentations.pytorch import ToTensorV2
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-dir", default="/data/buildings")
    parser.add_argument("--encoder", default="resnet34")
    parser.add_argument("--batch-size", type=int, default=16, help="per GPU")
    parser.add_argument("--epochs", type=int, default=80)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--save-dir", default="ckpt/unet")
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


class TileDataset(Dataset):
    def __init__(self, root, split, train):
        self.images = sorted(glob.glob(os.path.join(root, split, "images", "*.png")))
        self.masks = [p.replace("/images/", "/masks/") for p in self.images]
        if train:
            self.aug = A.Compose([A.RandomRotate90(), A.HorizontalFlip(), A.VerticalFlip(),
                                  A.ShiftScaleRotate(0.0625, 0.1, 15, border_mode=cv2.BORDER_REFLECT_101),
                                  A.RandomBrightnessContrast(0.2, 0.2), A.Normalize(), ToTensorV2()])
        else:
            self.aug = A.Compose([A.Normalize(), ToTensorV2()])

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        img = cv2.cvtColor(cv2.imread(self.images[i]), cv2.COLOR_BGR2RGB)
        mask = (cv2.imread(self.masks[i], cv2.IMREAD_GRAYSCALE) > 127).astype(np.float32)
        out = self.aug(image=img, mask=mask)
        return out["image"], out["mask"].unsqueeze(0)


def dice_loss(logits, target, eps=1.0):
    p = torch.sigmoid(logits)
    num = 2 * (p * target).sum((2, 3)) + eps
    den = p.sum((2, 3)) + target.sum((2, 3)) + eps
    return 1 - (num / den).mean()


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)   # intersection, union, loss*n
    for img, mask in loader:
        img, mask = img.to(device, non_blocking=True), mask.to(device, non_blocking=True)
        logits = model(img)
        pred = (logits > 0).float()
        stats[0] += (pred * mask).sum()
        stats[1] += ((pred + mask) > 0).float().sum()
        stats[2] += F.binary_cross_entropy_with_logits(logits, mask) * img.size(0)
    n = torch.tensor(float(len(loader.sampler)), device=device)
    dist.all_reduce(stats)
    dist.all_reduce(n)
    model.train()
    return (stats[0] / stats[1].clamp(min=1)).item(), (stats[2] / n).item()


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(17)
    cv2.setNumThreads(0)

    train_set = TileDataset(args.data_dir, "train", train=True)
    val_set = TileDataset(args.data_dir, "val", train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    model = smp.Unet(args.encoder, encoder_weights="imagenet", classes=1)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr * world_size, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_loader))
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        print(f"world_size={world_size} train tiles={len(train_set)} val tiles={len(val_set)}")

    best_iou = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        epoch_loss = torch.zeros((), device=device)
        for img, mask in train_loader:
            img, mask = img.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            with torch.autocast("cuda", enabled=args.amp):
                logits = model(img)
                loss = F.binary_cross_entropy_with_logits(logits, mask) + dice_loss(logits.float(), mask)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            epoch_loss += loss.detach()
        dist.all_reduce(epoch_loss)
        epoch_loss /= world_size * len(train_loader)

        iou, val_loss = validate(model, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch:3d} loss {epoch_loss.item():.4f} val_loss {val_loss:.4f} "
                  f"IoU {iou:.4f} ({time.time() - t0:.0f}s)")
            state = {"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save(state, os.path.join(args.save_dir, "last.pth"))
            if iou > best_iou:
                best_iou = iou
                torch.save(state, os.path.join(args.save_dir, "best.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
