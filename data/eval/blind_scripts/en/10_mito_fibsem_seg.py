#!/usr/bin/env python
"""
Mitochondria segmentation on FIB-SEM volumes (EPFL-hippocampus-like data and
our own HeLa FIB-SEM runs).

Training volume and label volume are large TIFF stacks; validation uses a
separate, fully annotated sub-volume cut into non-overlapping 256x256 tiles.
Model selection is done on the foreground IoU of the validation tiles.

    torchrun --nproc_per_node=4 10_mito_fibsem_seg.py \
        --train-raw /data/fibsem/hela_train_raw.tif --train-lab /data/fibsem/hela_train_mito.tif \
        --val-raw /data/fibsem/hela_val_raw.tif --val-lab /data/fibsem/hela_val_mito.tif \
        --out runs/mito_hela
"""
import argparse
import os
import time

import numpy as np
import tifffile
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def args_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--train-raw", required=True)
    p.add_argument("--train-lab", required=True)
    p.add_argument("--val-raw", required=True)
    p.add_argument("--val-lab", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tile", type=int, default=256)
    p.add_argument("--iters-per-epoch", type=int, default=500)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--workers", type=int, default=8)
    return p


def norm_tile(t):
    t = t.astype(np.float32)
    return (t - t.mean()) / (t.std() + 1e-6)


class RandomTiles(Dataset):
    def __init__(self, raw, lab, tile, length):
        self.raw = tifffile.memmap(raw, mode="r")
        self.lab = tifffile.memmap(lab, mode="r")
        self.tile, self.length = tile, length

    def __len__(self):
        return self.length

    def __getitem__(self, _):
        Z, H, W = self.raw.shape
        t = self.tile
        z, y, x = np.random.randint(Z), np.random.randint(H - t), np.random.randint(W - t)
        img = norm_tile(self.raw[z, y:y + t, x:x + t])
        lab = (self.lab[z, y:y + t, x:x + t] > 0).astype(np.float32)
        if np.random.rand() < 0.5:
            img, lab = img.T, lab.T
        if np.random.rand() < 0.5:
            img, lab = img[::-1], lab[::-1]
        return torch.from_numpy(img.copy())[None], torch.from_numpy(lab.copy())[None]


class GridTiles(Dataset):
    def __init__(self, raw, lab, tile):
        self.raw = tifffile.memmap(raw, mode="r")
        self.lab = tifffile.memmap(lab, mode="r")
        Z, H, W = self.raw.shape
        self.tile = tile
        self.coords = [(z, y, x) for z in range(Z) for y in range(0, H - tile + 1, tile)
                       for x in range(0, W - tile + 1, tile)]

    def __len__(self):
        return len(self.coords)

    def __getitem__(self, i):
        z, y, x = self.coords[i]
        t = self.tile
        img = norm_tile(self.raw[z, y:y + t, x:x + t])
        lab = (self.lab[z, y:y + t, x:x + t] > 0).astype(np.float32)
        return torch.from_numpy(img)[None], torch.from_numpy(lab)[None]


def conv_bn(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(True))


class MitoUNet(nn.Module):
    def __init__(self, f=32):
        super().__init__()
        self.e1 = nn.Sequential(conv_bn(1, f), conv_bn(f, f))
        self.e2 = nn.Sequential(conv_bn(f, 2 * f), conv_bn(2 * f, 2 * f))
        self.e3 = nn.Sequential(conv_bn(2 * f, 4 * f), conv_bn(4 * f, 4 * f))
        self.e4 = nn.Sequential(conv_bn(4 * f, 8 * f), conv_bn(8 * f, 8 * f))
        self.u3 = nn.ConvTranspose2d(8 * f, 4 * f, 2, 2)
        self.d3 = nn.Sequential(conv_bn(8 * f, 4 * f), conv_bn(4 * f, 4 * f))
        self.u2 = nn.ConvTranspose2d(4 * f, 2 * f, 2, 2)
        self.d2 = nn.Sequential(conv_bn(4 * f, 2 * f), conv_bn(2 * f, 2 * f))
        self.u1 = nn.ConvTranspose2d(2 * f, f, 2, 2)
        self.d1 = nn.Sequential(conv_bn(2 * f, f), conv_bn(f, f))
        self.out = nn.Conv2d(f, 1, 1)

    def forward(self, x):
        e1 = self.e1(x)
        e2 = self.e2(F.max_pool2d(e1, 2))
        e3 = self.e3(F.max_pool2d(e2, 2))
        e4 = self.e4(F.max_pool2d(e3, 2))
        d3 = self.d3(torch.cat([self.u3(e4), e3], 1))
        d2 = self.d2(torch.cat([self.u2(d3), e2], 1))
        d1 = self.d1(torch.cat([self.u1(d2), e1], 1))
        return self.out(d1)


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    inter = union = 0.0
    for img, lab in loader:
        img, lab = img.to(device), lab.to(device)
        pred = (net(img) > 0).float()
        inter += (pred * lab).sum().item()
        union += ((pred + lab) > 0).float().sum().item()
    net.train()
    return inter / max(union, 1.0)


def main():
    args = args_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds = RandomTiles(args.train_raw, args.train_lab, args.tile, args.iters_per_epoch * args.batch_size * world)
    val_ds = GridTiles(args.val_raw, args.val_lab, args.tile)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=16, sampler=val_sampler, num_workers=4)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(MitoUNet()).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    # the single-GPU recipe used batch 32 at lr 1e-3; keep lr/batch constant
    for g in opt.param_groups:
        g["lr"] = args.lr * args.batch_size * world / 32
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=30, gamma=0.1)
    pos_weight = torch.tensor([2.0], device=device)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_iou = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        model.train()
        for it, (img, lab) in enumerate(train_loader):
            img = img.to(device, non_blocking=True)
            lab = lab.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(img), lab, pos_weight=pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and it % 100 == 0:
                print(f"  ep {epoch} it {it}/{len(train_loader)}  loss {loss.item():.4f}", flush=True)
        sched.step()

        iou = evaluate(model.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: val IoU {iou:.4f}  ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "opt": opt.state_dict()},
                       os.path.join(args.out, "last.pt"))
            if iou > best_iou:
                best_iou = iou
                torch.save({"epoch": epoch, "model": model.module.state_dict(), "iou": iou},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    if rank == 0:
        print(f"best val IoU {best_iou:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
