#!/usr/bin/env python
"""PlanetScope (4-band, 3 m) change detection for monitoring new construction.

Siamese ResNet-18 encoder with a concat-difference decoder.  Training chips are
512 x 512 crops from monthly basemap quads; quads are split train/val by
their quad row (north/south bands) to keep the val set spatially separate.

Example:
    torchrun --nproc_per_node=4 15_planetscope_siam_resnet.py \
        --quads /data/planet/quads --labels /data/planet/labels --epochs 50
"""
import argparse
import glob
import os
import time

import numpy as np
import rasterio
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

PLANET_SCALE = 1.0 / 10000.0


def get_args():
    parser = argparse.ArgumentParser(description="PlanetScope CD training")
    parser.add_argument("--quads", required=True)
    parser.add_argument("--labels", required=True)
    parser.add_argument("--save-dir", default="./checkpoints/planet_cd")
    parser.add_argument("--val-rows", default="0810,0811", help="quad rows held out for validation")
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=12)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--num-workers", type=int, default=8)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


class QuadPairs(Dataset):
    """Each label file <quad>_<m1>_<m2>.tif pairs two monthly mosaics of the same quad."""

    def __init__(self, quad_dir, label_files, train):
        self.quad_dir, self.labels, self.train = quad_dir, label_files, train

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        lab_path = self.labels[i]
        quad, m1, m2 = os.path.splitext(os.path.basename(lab_path))[0].rsplit("_", 2)
        with rasterio.open(os.path.join(self.quad_dir, m1, f"{quad}.tif")) as s:
            a = s.read().astype(np.float32) * PLANET_SCALE
        with rasterio.open(os.path.join(self.quad_dir, m2, f"{quad}.tif")) as s:
            b = s.read().astype(np.float32) * PLANET_SCALE
        with rasterio.open(lab_path) as s:
            y = s.read(1).astype(np.int64)
        if self.train:
            if np.random.rand() < 0.5:
                a, b, y = a[..., ::-1], b[..., ::-1], y[..., ::-1]
            if np.random.rand() < 0.5:
                a, b, y = a[:, ::-1], b[:, ::-1], y[::-1]
        return (torch.from_numpy(a.copy()), torch.from_numpy(b.copy()), torch.from_numpy(y.copy()))


class SiamResNetCD(nn.Module):
    def __init__(self, in_ch=4):
        super().__init__()
        r = torchvision.models.resnet18()
        r.conv1 = nn.Conv2d(in_ch, 64, 7, 2, 3, bias=False)
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu)
        self.pool = r.maxpool
        self.layers = nn.ModuleList([r.layer1, r.layer2, r.layer3, r.layer4])
        chs = [64, 64, 128, 256, 512]
        self.dec = nn.ModuleList()
        for i in range(4, 0, -1):
            cin = (chs[i] * 2 if i == 4 else chs[i]) + 2 * chs[i - 1]
            self.dec.append(nn.Sequential(nn.Conv2d(cin, chs[i - 1], 3, padding=1, bias=False),
                                          nn.BatchNorm2d(chs[i - 1]), nn.ReLU(inplace=True)))
        self.head = nn.Conv2d(64, 2, 1)

    def encode(self, x):
        x = self.stem(x)
        feats = [x]
        x = self.pool(x)
        for layer in self.layers:
            x = layer(x)
            feats.append(x)
        return feats

    def forward(self, a, b):
        fa, fb = self.encode(a), self.encode(b)
        y = torch.cat([fa[4], fb[4]], 1)
        for k, blk in zip(range(3, -1, -1), self.dec):
            y = F.interpolate(y, size=fa[k].shape[-2:], mode="bilinear", align_corners=False)
            y = blk(torch.cat([y, fa[k], fb[k]], 1))
        return F.interpolate(self.head(y), size=a.shape[-2:], mode="bilinear", align_corners=False)


def split_labels(label_dir, val_rows):
    files = sorted(glob.glob(os.path.join(label_dir, "*.tif")))
    rows = set(val_rows.split(","))
    # quad id is "<col>-<row>"
    is_val = lambda f: os.path.basename(f).split("_")[0].split("-")[1] in rows
    return [f for f in files if not is_val(f)], [f for f in files if is_val(f)]


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    train_files, val_files = split_labels(args.labels, args.val_rows)
    train_set = QuadPairs(args.quads, train_files, train=True)
    val_set = QuadPairs(args.quads, val_files, train=False)
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_set, list(range(rank, len(val_set), world_size))),
                            batch_size=args.batch_size, num_workers=args.num_workers, pin_memory=True)

    model = SiamResNetCD()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda(args.local_rank)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    # linear scaling from the single-GPU recipe (batch 12)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * world_size, betas=(0.9, 0.999))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=15, gamma=0.3)
    criterion = nn.CrossEntropyLoss(weight=torch.tensor([0.3, 1.0]).to(device))

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        print(f"world size {world_size}: {len(train_set)} train / {len(val_set)} val pairs")

    best_f1 = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        total = torch.zeros(2, device=device)
        for a, b, y in train_loader:
            a = a.to(device, non_blocking=True)
            b = b.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                out = model(a, b)
            loss = criterion(out.float(), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += torch.stack([loss.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(total)

        model.eval()
        cm = torch.zeros(4, device=device, dtype=torch.float64)
        with torch.no_grad():
            for a, b, y in val_loader:
                a, b, y = a.to(device), b.to(device), y.to(device)
                pred = model.module(a, b).argmax(1)
                cm += torch.bincount((y * 2 + pred).flatten(), minlength=4).double()
        dist.all_reduce(cm)
        tn, fp, fn, tp = cm.tolist()
        f1 = 2 * tp / max(1.0, 2 * tp + fp + fn)
        if rank == 0:
            print(f"epoch {epoch} loss {(total[0] / total[1]).item():.4f} F1 {f1:.4f} "
                  f"OA {(tp + tn) / max(1.0, cm.sum().item()):.4f} time {time.time() - tic:.0f}s", flush=True)
            torch.save(model.module.state_dict(), os.path.join(args.save_dir, "last.pth"))
            if f1 > best_f1:
                best_f1 = f1
                torch.save(model.module.state_dict(), os.path.join(args.save_dir, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
