"""Flood water mapping from Sentinel-1 GRD (VV, VH) on Sen1Floods11 hand-labelled chips.

Jobs on the shared queue are preempted after 4 h, so training resumes from the
latest checkpoint (--resume auto) and keeps going until --epochs is reached.

    torchrun --nproc_per_node=4 18_sen1floods11_unet.py --root /data/sen1floods11 --resume auto
"""
import argparse
import csv
import glob
import os
import time

import numpy as np
import rasterio
import segmentation_models_pytorch as smp
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

S1_MEAN = np.array([-11.2, -18.4], np.float32)[:, None, None]  # dB
S1_STD = np.array([3.6, 4.1], np.float32)[:, None, None]


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/sen1floods11")
    ap.add_argument("--ckpt-dir", default="/data/sen1floods11/checkpoints/unet_r34_s1")
    ap.add_argument("--resume", default="", help="path, or 'auto' for <ckpt-dir>/last.pth")
    ap.add_argument("--epochs", type=int, default=120)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--crop", type=int, default=256)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--save-every", type=int, default=2)
    return ap.parse_args()


def read_split(root, split):
    with open(os.path.join(root, "splits", "flood_handlabeled", f"flood_{split}_data.csv")) as f:
        rows = list(csv.reader(f))
    return [(os.path.join(root, "data", "flood_events", "HandLabeled", "S1Hand", s1),
             os.path.join(root, "data", "flood_events", "HandLabeled", "LabelHand", lab)) for s1, lab in rows]


class S1Chips(Dataset):
    def __init__(self, pairs, crop=None):
        self.pairs, self.crop = pairs, crop

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        s1_path, lab_path = self.pairs[i]
        with rasterio.open(s1_path) as src:
            x = src.read().astype(np.float32)
        with rasterio.open(lab_path) as src:
            y = src.read(1).astype(np.int64)
        x = np.nan_to_num(x, nan=0.0)
        x = np.clip((x - S1_MEAN) / S1_STD, -5, 5)
        y[y == -1] = 255
        if self.crop:
            h, w = y.shape
            r, c = np.random.randint(0, h - self.crop + 1), np.random.randint(0, w - self.crop + 1)
            x, y = x[:, r:r + self.crop, c:c + self.crop], y[r:r + self.crop, c:c + self.crop]
            k = np.random.randint(4)
            x, y = np.rot90(x, k, (1, 2)), np.rot90(y, k)
        return torch.from_numpy(x.copy()), torch.from_numpy(y.copy())


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds = S1Chips(read_split(args.root, "train"), crop=args.crop)
    val_pairs = read_split(args.root, "valid")
    val_ds = S1Chips(val_pairs[rank::world])
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=8, shuffle=False, num_workers=2)

    model = smp.Unet("resnet34", encoder_weights=None, in_channels=2, classes=2)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0=30, T_mult=1)
    criterion = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 4.0], device=device), ignore_index=255)

    start_epoch, best_iou = 0, 0.0
    resume = os.path.join(args.ckpt_dir, "last.pth") if args.resume == "auto" else args.resume
    if resume and os.path.isfile(resume):
        ckpt = torch.load(resume)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1
        best_iou = ckpt.get("best_iou", 0.0)
        if rank == 0:
            print(f"resumed from {resume} at epoch {start_epoch} (best IoU {best_iou:.4f})", flush=True)
        del ckpt
    model = DDP(model, device_ids=[local_rank])

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(loss_sum)

        model.eval()
        s = torch.zeros(3, dtype=torch.float64, device=device)
        with torch.no_grad():
            for x, y in val_dl:
                x, y = x.to(device), y.to(device)
                pred = model.module(x).argmax(1)
                v = y != 255
                s += torch.stack([((pred == 1) & (y == 1) & v).sum(), ((pred == 1) & (y == 0) & v).sum(),
                                  ((pred == 0) & (y == 1) & v).sum()]).double()
        dist.all_reduce(s)
        tp, fp, fn = s.tolist()
        iou = tp / max(tp + fp + fn, 1)

        if rank == 0:
            print(f"epoch {epoch:3d} loss {(loss_sum[0] / loss_sum[1]).item():.4f} water IoU {iou:.4f} "
                  f"lr {scheduler.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)
            is_best = iou > best_iou
            best_iou = max(iou, best_iou)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch, "best_iou": best_iou}
            if is_best:
                torch.save(state, os.path.join(args.ckpt_dir, "best.pth"))
            if (epoch + 1) % args.save_every == 0 or epoch + 1 == args.epochs:
                tmp = os.path.join(args.ckpt_dir, "last.pth.tmp")
                torch.save(state, tmp)
                os.replace(tmp, os.path.join(args.ckpt_dir, "last.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
