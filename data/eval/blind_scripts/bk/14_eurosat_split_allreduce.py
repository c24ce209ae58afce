#!/usr/bin/env python
"""EuroSAT (RGB, 10 land-cover classes) with a ResNet-50 backbone.

Plain torch.distributed data parallelism: weights broadcast from rank 0 at
start-up, gradients summed with all_reduce and divided by the world size.
EuroSAT ships without an official split, so 80/20 is drawn here.

    torchrun --nproc_per_node=4 14_eurosat_split_allreduce.py --root /data/EuroSAT_RGB
"""
import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as T
from torch.utils.data import DataLoader, Dataset, random_split
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder
from torchvision.models import ResNet50_Weights, resnet50


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--val-frac", type=float, default=0.2)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--freeze-epochs", type=int, default=2, help="train only the head first")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default="checkpoints/eurosat_r50.pt")
    return ap.parse_args()


class WithTransform(Dataset):
    def __init__(self, subset, transform):
        self.subset = subset
        self.transform = transform

    def __len__(self):
        return len(self.subset)

    def __getitem__(self, i):
        img, y = self.subset[i]
        return self.transform(img), y


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@torch.no_grad()
def broadcast_params(model):
    for t in model.state_dict().values():
        dist.broadcast(t, src=0)


def allreduce_grads(params, world):
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world


@torch.no_grad()
def validate(model, loader, device, n_classes):
    model.eval()
    per_class = torch.zeros(2, n_classes, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        pred = model(x).argmax(1)
        per_class[0].index_add_(0, y, (pred == y).float())
        per_class[1].index_add_(0, y, torch.ones_like(y, dtype=torch.float))
    dist.all_reduce(per_class)
    acc = per_class[0].sum() / per_class[1].sum()
    return acc.item(), (per_class[0] / per_class[1].clamp(min=1)).cpu()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    # different augmentation stream on each replica
    set_seed(args.seed + rank)

    weights = ResNet50_Weights.IMAGENET1K_V2
    norm = T.Normalize(weights.transforms().mean, weights.transforms().std)
    train_tf = T.Compose([T.RandomResizedCrop(224, scale=(0.6, 1.0)), T.RandomHorizontalFlip(),
                          T.RandomVerticalFlip(), T.ToTensor(), norm])
    val_tf = T.Compose([T.Resize(224), T.ToTensor(), norm])

    full = ImageFolder(args.root)
    n_val = int(len(full) * args.val_frac)
    train_sub, val_sub = random_split(full, [len(full) - n_val, n_val])
    train_ds = WithTransform(train_sub, train_tf)
    val_ds = WithTransform(val_sub, val_tf)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=8,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=128, sampler=val_sampler, num_workers=8, pin_memory=True)

    model = resnet50(weights=weights)
    model.fc = nn.Linear(model.fc.in_features, len(full.classes))
    model.to(device)
    broadcast_params(model)

    head = list(model.fc.parameters())
    backbone = [p for n, p in model.named_parameters() if not n.startswith("fc.")]
    opt = torch.optim.SGD([{"params": backbone, "lr": args.lr * 0.1}, {"params": head, "lr": args.lr}],
                          momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        frozen = epoch < args.freeze_epochs
        for p in backbone:
            p.requires_grad_(not frozen)
        model.train()
        if frozen:
            # keep BN statistics of the pretrained backbone while only the head trains
            for m in model.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.eval()
        t0 = time.time()
        for step, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            allreduce_grads(head if frozen else head + backbone, world)
            opt.step()
            if rank == 0 and step % 50 == 0:
                print(f"epoch {epoch} step {step}/{len(train_dl)} loss {loss.item():.4f}"
                      f"{' (head only)' if frozen else ''}", flush=True)
        sched.step()

        # BN running stats are per replica; average them so every rank evaluates the same model
        with torch.no_grad():
            for b in model.buffers():
                if b.is_floating_point():
                    dist.all_reduce(b, op=dist.ReduceOp.AVG)

        acc, per_class = validate(model, val_dl, device, len(full.classes))
        if rank == 0:
            worst = per_class.argmin().item()
            print(f"epoch {epoch} val acc {acc:.4f} worst class {full.classes[worst]} "
                  f"{per_class[worst]:.3f} ({time.time() - t0:.0f}s)", flush=True)
            if acc > best:
                best = acc
                os.makedirs(os.path.dirname(args.out), exist_ok=True)
                torch.save({"model": model.state_dict(), "classes": full.classes, "acc": acc}, args.out)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
