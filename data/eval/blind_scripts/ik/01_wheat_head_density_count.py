#!/usr/bin/env python
"""Wheat head counting on drone plot tiles (density-map regression).

CSRNet-style counter trained on point-annotated plot tiles. An auxiliary
plot-level count regressor is trained on the frontend features during the
first epochs only, it helps the density head converge on sparse early-season
plots.

    torchrun --nproc_per_node=4 01_wheat_head_density_count.py --data-root /data/gwhd_plots
"""
import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from scipy.ndimage import gaussian_filter
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.transforms import functional as TF


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", required=True)
    p.add_argument("--train-csv", default="train.csv")
    p.add_argument("--val-csv", default="val.csv")
    p.add_argument("--out-dir", default="runs/wheat_count")
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=8, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--crop", type=int, default=512)
    p.add_argument("--sigma", type=float, default=4.0)
    p.add_argument("--aux-epochs", type=int, default=30)
    p.add_argument("--aux-weight", type=float, default=0.1)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--resume", default="")
    p.add_argument("--seed", type=int, default=17)
    return p.parse_args()


class WheatPlotDataset(Dataset):
    """Plot tiles (1024x1024 RGB) with head centre points stored as JSON in the CSV."""

    MEAN = [0.485, 0.456, 0.406]
    STD = [0.229, 0.224, 0.225]

    def __init__(self, root, csv_file, crop, sigma, train):
        self.root = Path(root)
        self.df = pd.read_csv(self.root / csv_file)
        self.crop = crop
        self.sigma = sigma
        self.train = train

    def __len__(self):
        return len(self.df)

    def __getitem__(self, idx):
        row = self.df.iloc[idx]
        img = Image.open(self.root / "images" / row["image"]).convert("RGB")
        pts = np.asarray(json.loads(row["points"]), dtype=np.float32).reshape(-1, 2)
        w, h = img.size
        if self.train:
            c = self.crop
            x0 = np.random.randint(0, w - c + 1)
            y0 = np.random.randint(0, h - c + 1)
            img = img.crop((x0, y0, x0 + c, y0 + c))
            pts = pts - np.array([x0, y0], dtype=np.float32)
            keep = (pts[:, 0] >= 0) & (pts[:, 0] < c) & (pts[:, 1] >= 0) & (pts[:, 1] < c)
            pts = pts[keep]
            w = h = c
            if np.random.rand() < 0.5:
                img = TF.hflip(img)
                pts[:, 0] = w - 1 - pts[:, 0]
            if np.random.rand() < 0.5:
                img = TF.vflip(img)
                pts[:, 1] = h - 1 - pts[:, 1]
            img = TF.adjust_brightness(img, np.random.uniform(0.75, 1.25))
            img = TF.adjust_saturation(img, np.random.uniform(0.8, 1.2))
            img = TF.adjust_hue(img, np.random.uniform(-0.03, 0.03))
        w8, h8 = (w // 8) * 8, (h // 8) * 8
        img = img.crop((0, 0, w8, h8))
        density = np.zeros((h8, w8), dtype=np.float32)
        for x, y in pts:
            xi, yi = int(x), int(y)
            if 0 <= xi < w8 and 0 <= yi < h8:
                density[yi, xi] += 1.0
        density = gaussian_filter(density, self.sigma, mode="constant")
        # sum-pool to the 1/8 output grid, the integral stays the head count
        density = density.reshape(h8 // 8, 8, w8 // 8, 8).sum(axis=(1, 3))
        x = TF.normalize(TF.to_tensor(img), self.MEAN, self.STD)
        count = torch.tensor(float(density.sum()))
        return x, torch.from_numpy(density)[None], count


class DensityCounter(nn.Module):
    def __init__(self, pretrained=True):
        super().__init__()
        vgg = torchvision.models.vgg16_bn(weights="IMAGENET1K_V1" if pretrained else None)
        self.frontend = nn.Sequential(*list(vgg.features.children())[:33])  # conv4_3, stride 8
        layers, c_in = [], 512
        for c in [512, 512, 512, 256, 128, 64]:
            layers += [nn.Conv2d(c_in, c, 3, padding=2, dilation=2), nn.BatchNorm2d(c), nn.ReLU(inplace=True)]
            c_in = c
        self.backend = nn.Sequential(*layers)
        self.density_head = nn.Conv2d(64, 1, 1)
        self.count_head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 128), nn.ReLU(inplace=True), nn.Linear(128, 1)
        )

    def forward(self, x, with_aux=False):
        f = self.frontend(x)
        d = F.relu(self.density_head(self.backend(f)))
        if with_aux:
            return d, self.count_head(f).squeeze(1)
        return d


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device, dtype=torch.float64)  # abs err, sq err, n
    for x, _, count in loader:
        x = x.to(device, non_blocking=True)
        count = count.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            pred = model(x).float().sum(dim=(1, 2, 3))
        err = pred - count
        stats[0] += err.abs().sum()
        stats[1] += (err ** 2).sum()
        stats[2] += x.size(0)
    dist.all_reduce(stats)
    mae = (stats[0] / stats[2]).item()
    rmse = (stats[1] / stats[2]).sqrt().item()
    return mae, rmse


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    is_main = rank == 0
    out_dir = Path(args.out_dir)
    if is_main:
        out_dir.mkdir(parents=True, exist_ok=True)

    train_ds = WheatPlotDataset(args.data_root, args.train_csv, args.crop, args.sigma, train=True)
    val_ds = WheatPlotDataset(args.data_root, args.val_csv, args.crop, args.sigma, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    # full-size tiles, one per batch; each rank takes a strided shard so that no tile is counted twice
    val_shard = Subset(val_ds, list(range(rank, len(val_ds), world)))
    val_loader = DataLoader(val_shard, batch_size=1, shuffle=False, num_workers=2, pin_memory=True)

    model = DensityCounter()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    # count_head only takes part during the first aux-epochs
    ddp_model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs, eta_min=1e-6)
    scaler = torch.cuda.amp.GradScaler()
    start_epoch, best_mae = 0, float("inf")

    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_mae = ckpt["epoch"] + 1, ckpt["best_mae"]

    for epoch in range(start_epoch, args.epochs):
        ddp_model.train()
        train_sampler.set_epoch(epoch)
        use_aux = epoch < args.aux_epochs
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for x, dens, count in train_loader:
            x = x.to(device, non_blocking=True)
            dens = dens.to(device, non_blocking=True)
            count = count.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                if use_aux:
                    pred, pred_count = ddp_model(x, with_aux=True)
                else:
                    pred = ddp_model(x)
                loss = F.mse_loss(pred.float(), dens, reduction="sum") / x.size(0)
                if use_aux:
                    loss = loss + args.aux_weight * F.smooth_l1_loss(pred_count.float(), count)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            running[0] += loss.detach().float()
            running[1] += 1
        scheduler.step()

        dist.all_reduce(running)
        mae, rmse = evaluate(model, val_loader, device)
        if is_main:
            rec = {"epoch": epoch, "loss": (running[0] / running[1]).item(), "val_mae": mae, "val_rmse": rmse,
                   "lr": scheduler.get_last_lr()[0], "time": time.time() - t0}
            print(json.dumps(rec), flush=True)
            with open(out_dir / "log.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")
            ckpt = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                    "epoch": epoch, "best_mae": min(best_mae, mae)}
            torch.save(ckpt, out_dir / "last.pt")
            if mae < best_mae:
                torch.save(model.state_dict(), out_dir / "best.pt")
        best_mae = min(best_mae, mae)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
