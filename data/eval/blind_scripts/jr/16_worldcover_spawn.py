#!/usr/bin/env python
"""
ESA WorldCover 2021 label distillation into a Sentinel-2 segmentation model.
Single-node, launched with torch.multiprocessing (no torchrun on the cluster image we use):

    python 16_worldcover_spawn.py --tiles /data/wc21/tiles.parquet --gpus 4 --out /data/wc21/runs/upernet_cnx

The WorldCover map codes are 10, 20, ..., 100 (and 95 for mangroves); they are mapped to 0..10 here.
"""
import argparse
import os
import socket
import time

import numpy as np
import pandas as pd
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

WC_CODES = [10, 20, 30, 40, 50, 60, 70, 80, 90, 95, 100]
WC_NAMES = ["tree", "shrub", "grass", "crop", "built", "bare", "snow_ice", "water", "herb_wetland", "mangrove", "moss"]
LUT = np.full(256, 255, dtype=np.uint8)
for idx, code in enumerate(WC_CODES):
    LUT[code] = idx
NUM_CLASSES = len(WC_CODES)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class WorldCoverTiles(Dataset):
    def __init__(self, df, augment):
        self.s2 = df["s2_path"].tolist()
        self.lbl = df["label_path"].tolist()
        self.augment = augment

    def __len__(self):
        return len(self.s2)

    def __getitem__(self, i):
        with rasterio.open(self.s2[i]) as src:
            x = src.read().astype(np.float32)  # 10 bands, L2A * 1e4
        with rasterio.open(self.lbl[i]) as src:
            y = LUT[src.read(1)].astype(np.int64)
        x = np.log1p(np.clip(x, 0, 12000)) / np.log1p(12000.0)
        if self.augment:
            k = np.random.randint(4)
            x, y = np.rot90(x, k, axes=(1, 2)), np.rot90(y, k)
            if np.random.rand() < 0.5:
                x, y = x[:, ::-1], y[::-1]
        return torch.from_numpy(x.copy()), torch.from_numpy(y.copy())


def confusion(pred, target, n):
    keep = target != 255
    return torch.bincount(target[keep] * n + pred[keep], minlength=n * n).view(n, n)


def main_worker(gpu, ngpus, args):
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", init_method="env://", rank=gpu, world_size=ngpus)
    device = torch.device("cuda", gpu)
    is_main = gpu == 0

    df = pd.read_parquet(args.tiles)  # columns: s2_path, label_path, split (fixed at export, by MGRS tile)
    train_ds = WorldCoverTiles(df[df["split"] == "train"], augment=True)
    val_ds = WorldCoverTiles(df[df["split"] == "val"], augment=False)
    sampler = DistributedSampler(train_ds, num_replicas=ngpus, rank=gpu, shuffle=True, seed=args.seed)
    per_gpu = args.batch_size // ngpus  # keep the global batch (and the tuned lr) independent of the GPU count
    train_dl = DataLoader(train_ds, batch_size=per_gpu, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val_ds, range(gpu, len(val_ds), ngpus)), batch_size=per_gpu,
                        num_workers=args.workers)

    torch.manual_seed(args.seed)  # identical init everywhere (DDP broadcasts rank 0's weights anyway)
    model = smp.UPerNet("tu-convnext_tiny", encoder_weights=None, in_channels=10, classes=NUM_CLASSES)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[gpu])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    iters = args.epochs * len(train_dl)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=iters, pct_start=0.05)

    start_epoch, best = 0, 0.0
    last_path = os.path.join(args.out, "last.pt")
    if args.resume and os.path.isfile(last_path):
        ckpt = torch.load(last_path, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            loss = F.cross_entropy(logits.float(), y, ignore_index=255, label_smoothing=0.05)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])

        net = model.module
        net.eval()
        cm = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.long, device=device)
        with torch.no_grad():
            for x, y in val_dl:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    pred = net(x).argmax(1)
                cm += confusion(pred, y, NUM_CLASSES)
        dist.all_reduce(cm)
        dist.all_reduce(acc)
        cmd = cm.double()
        iou = cmd.diag() / (cmd.sum(0) + cmd.sum(1) - cmd.diag()).clamp(min=1)
        miou = iou[cmd.sum(1) > 0].mean().item()

        if is_main:
            print(f"epoch {epoch:3d} loss {(acc[0] / acc[1]).item():.4f} mIoU {miou:.4f} "
                  + " ".join(f"{n}:{v:.2f}" for n, v in zip(WC_NAMES, iou.tolist()))
                  + f" ({time.time() - t0:.0f}s)", flush=True)
            best = max(best, miou)
            state = {"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch, "best": best}
            torch.save(state, last_path + ".tmp")
            os.replace(last_path + ".tmp", last_path)
            if miou >= best:
                torch.save(net.state_dict(), os.path.join(args.out, "best_model.pt"))
        dist.barrier()

    dist.destroy_process_group()


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--tiles", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=64, help="global batch size")
    p.add_argument("--lr", type=float, default=4e-4)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


if __name__ == "__main__":
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(main_worker, args=(args.gpus, args), nprocs=args.gpus, join=True)
