#!/usr/bin/env python
"""Galaxy10 DECaLS morphology classifier (ResNet-18 / ResNet-50 backbone).

Trains on the Galaxy10_DECals.h5 file (17736 colour cutouts, 256x256, 10 classes).
Multi-GPU via DDP, launched with torchrun on one node of the group cluster.
"""
import argparse
import json
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.transforms import v2 as T

CLASS_NAMES = [
    "disturbed", "merging", "round_smooth", "in_between_smooth", "cigar_smooth",
    "barred_spiral", "unbarred_tight_spiral", "unbarred_loose_spiral",
    "edge_on_no_bulge", "edge_on_with_bulge",
]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/astro/galaxy10/Galaxy10_DECals.h5")
    p.add_argument("--split-file", default="/data/astro/galaxy10/split_seed42.json")
    p.add_argument("--arch", default="resnet18", choices=["resnet18", "resnet50"])
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--wd", type=float, default=5e-2)
    p.add_argument("--crop", type=int, default=192)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--out", default="runs/galaxy10")
    return p.parse_args()


class Galaxy10(Dataset):
    """Lazily opens the h5 file in each worker (h5py handles do not survive fork)."""

    def __init__(self, path, indices, transform=None):
        self.path = path
        self.indices = np.asarray(indices)
        self.transform = transform
        self._h5 = None
        with h5py.File(path, "r") as f:
            self.labels = f["ans"][:].astype(np.int64)

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        if self._h5 is None:
            self._h5 = h5py.File(self.path, "r")
        idx = self.indices[i]
        img = torch.from_numpy(self._h5["images"][idx]).permute(2, 0, 1)  # uint8 CHW
        if self.transform is not None:
            img = self.transform(img)
        return img, self.labels[idx]


def build_transforms(crop):
    mean = [0.167, 0.160, 0.152]
    std = [0.129, 0.115, 0.106]
    train_tf = T.Compose([
        T.RandomRotation(180),
        T.CenterCrop(crop),
        T.RandomHorizontalFlip(),
        T.RandomVerticalFlip(),
        T.ToDtype(torch.float32, scale=True),
        T.Normalize(mean, std),
    ])
    eval_tf = T.Compose([
        T.CenterCrop(crop),
        T.ToDtype(torch.float32, scale=True),
        T.Normalize(mean, std),
    ])
    return train_tf, eval_tf


def build_model(arch, n_classes=10):
    net = getattr(torchvision.models, arch)(weights=None)
    net.fc = nn.Linear(net.fc.in_features, n_classes)
    return net


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # loss_sum, correct, count
    for x, y in loader:
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        logits = model(x)
        stats[0] += F.cross_entropy(logits, y, reduction="sum")
        stats[1] += (logits.argmax(1) == y).sum()
        stats[2] += y.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    args = get_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    torch.manual_seed(1234 + rank)
    torch.backends.cudnn.benchmark = True

    with open(args.split_file) as f:
        split = json.load(f)
    train_tf, eval_tf = build_transforms(args.crop)
    train_ds = Galaxy10(args.data, split["train"], train_tf)
    val_ds = Galaxy10(args.data, split["val"], eval_tf)
    # every rank evaluates a disjoint strided slice, results summed with all_reduce
    val_shard = Subset(val_ds, list(range(rank, len(val_ds), world)))

    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_shard, batch_size=2 * args.batch_size, shuffle=False,
                            num_workers=args.workers, pin_memory=True)

    model = build_model(args.arch).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wd)
    steps_per_epoch = len(train_loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=args.lr, total_steps=args.epochs * steps_per_epoch, pct_start=0.1)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    if is_main:
        os.makedirs(args.out, exist_ok=True)
        print(f"world={world} train={len(train_ds)} val={len(val_ds)} "
              f"steps/epoch={steps_per_epoch}", flush=True)

    best_acc = 0.0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for x, y in train_loader:
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                logits = model(x)
                loss = F.cross_entropy(logits, y, label_smoothing=0.05)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            running[0] += loss.detach() * y.numel()
            running[1] += y.numel()

        dist.all_reduce(running)
        train_loss = (running[0] / running[1]).item()
        val_loss, val_acc = evaluate(model.module, val_loader, device)

        if is_main:
            print(f"epoch {epoch:3d} train_loss {train_loss:.4f} val_loss {val_loss:.4f} "
                  f"val_acc {val_acc:.4f} lr {sched.get_last_lr()[0]:.2e} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            state = {
                "epoch": epoch,
                "model": model.module.state_dict(),
                "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(),
                "val_acc": val_acc,
                "args": vars(args),
            }
            torch.save(state, os.path.join(args.out, "last.pt"))
            if val_acc > best_acc:
                best_acc = val_acc
                torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

    if is_main:
        print(f"best val acc {best_acc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
