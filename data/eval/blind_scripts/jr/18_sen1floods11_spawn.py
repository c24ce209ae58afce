#!/usr/bin/env python
"""
Flood water segmentation from Sentinel-1 (VV, VH) on Sen1Floods11 hand-labelled chips.

Launch on one node (spawns one process per visible GPU):
    python 18_sen1floods11_spawn.py --root /data/sen1floods11/v1.1 --out runs/floods_unet

Labels: -1 no data, 0 not water, 1 water. The official hand-labelled split CSVs are used
(flood_train_data.csv / flood_valid_data.csv / flood_test_data.csv).
"""
import argparse
import csv
import os
import random
import time

import numpy as np
import rasterio
import segmentation_models_pytorch as smp
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

S1_MEAN = np.array([-10.41, -17.14], np.float32)[:, None, None]
S1_STD = np.array([3.86, 4.45], np.float32)[:, None, None]


def read_split(root, name):
    with open(os.path.join(root, "splits", "flood_handlabeled", name)) as f:
        return [(row[0], row[1]) for row in csv.reader(f) if row]


class FloodChips(Dataset):
    def __init__(self, root, pairs, train, crop=256):
        self.s1_dir = os.path.join(root, "data", "flood_events", "HandLabeled", "S1Hand")
        self.lbl_dir = os.path.join(root, "data", "flood_events", "HandLabeled", "LabelHand")
        self.pairs = pairs
        self.train = train
        self.crop = crop

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        s1_name, lbl_name = self.pairs[i]
        with rasterio.open(os.path.join(self.s1_dir, s1_name)) as src:
            x = src.read().astype(np.float32)
        with rasterio.open(os.path.join(self.lbl_dir, lbl_name)) as src:
            y = src.read(1).astype(np.int64)
        x = np.nan_to_num(x, nan=-30.0)
        x = (np.clip(x, -50, 1) - S1_MEAN) / S1_STD
        y[y < 0] = 255
        if self.train:
            h, w = y.shape
            r, c = random.randint(0, h - self.crop), random.randint(0, w - self.crop)
            x, y = x[:, r:r + self.crop, c:c + self.crop], y[r:r + self.crop, c:c + self.crop]
            if random.random() < 0.5:
                x, y = x[:, :, ::-1], y[:, ::-1]
            if random.random() < 0.5:
                x, y = x[:, ::-1], y[::-1]
        return torch.from_numpy(x.copy()), torch.from_numpy(y.copy())


def setup(rank, world_size, port):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)


@torch.no_grad()
def run_eval(model, loader, device):
    model.eval()
    c = torch.zeros(2, device=device, dtype=torch.float64)  # water intersection, union
    tot = torch.zeros(2, device=device, dtype=torch.float64)  # correct, valid pixels
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        pred = model(x).argmax(1)
        valid = y != 255
        p, t = pred[valid] == 1, y[valid] == 1
        c[0] += (p & t).sum()
        c[1] += (p | t).sum()
        tot[0] += (pred[valid] == y[valid]).sum()
        tot[1] += valid.sum()
    dist.all_reduce(c)
    dist.all_reduce(tot)
    model.train()
    return (c[0] / c[1].clamp(min=1)).item(), (tot[0] / tot[1].clamp(min=1)).item()


def train_worker(rank, args, world_size):
    setup(rank, world_size, args.port)
    device = torch.device("cuda", rank)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    train_ds = FloodChips(args.root, read_split(args.root, "flood_train_data.csv"), train=True, crop=args.crop)
    valid_ds = FloodChips(args.root, read_split(args.root, "flood_valid_data.csv"), train=False)
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True)
    valid_dl = DataLoader(Subset(valid_ds, range(rank, len(valid_ds), world_size)), batch_size=4,
                          num_workers=args.workers)

    model = smp.Unet("resnet34", encoder_weights=None, in_channels=2, classes=2)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[rank])
    # water is ~10% of the valid pixels
    criterion = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 8.0], device=device), ignore_index=255)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0=10)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(train_ds)} train chips, {len(valid_ds)} valid chips, {world_size} GPUs", flush=True)

    best_iou = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for i, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step(epoch + i / len(train_dl))
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(running)
        iou, acc = run_eval(model.module, valid_dl, device)
        if rank == 0:
            print(f"epoch {epoch:3d}  loss {(running[0] / running[1]).item():.4f}  water IoU {iou:.4f}  "
                  f"acc {acc:.4f}  {time.time() - t0:.1f}s", flush=True)
            if iou > best_iou:
                best_iou = iou
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch}, os.path.join(args.out, "last.pt"))
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", default="runs/floods")
    parser.add_argument("--epochs", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--crop", type=int, default=256)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--port", type=int, default=29531)
    parser.add_argument("--seed", type=int, default=3)
    args = parser.parse_args()

    world_size = torch.cuda.device_count()
    mp.spawn(train_worker, args=(world_size, args), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
