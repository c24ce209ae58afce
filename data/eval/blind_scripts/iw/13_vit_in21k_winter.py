#!/usr/bin/env python3
"""ViT-B/16 on ImageNet-21k winter21 (no official val split).

We hold out `--holdout-per-class` images of every class as a validation set and train on
the rest. Mixup/cutmix, repeated augmentation off (21k is large enough), EMA.
"""
import argparse
import json
import os
import random
import time
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets

import timm
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import CosineLRScheduler
from timm.utils import ModelEmaV2, NativeScaler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/datasets/imagenet21k_winter21/train")
    ap.add_argument("--holdout-per-class", type=int, default=10)
    ap.add_argument("--model", default="vit_base_patch16_224")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=90)
    ap.add_argument("--lr", type=float, default=1e-3, help="for global batch 4096")
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--warmup-epochs", type=int, default=8)
    ap.add_argument("--drop-path", type=float, default=0.1)
    ap.add_argument("--ema-decay", type=float, default=0.9998)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--out", default="/checkpoint/vit_b16_in21k_w21")
    ap.add_argument("--seed", type=int, default=42)
    return ap.parse_args()


def fix_seeds(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)


def holdout_split(targets, per_class):
    """Return (train_indices, val_indices) with `per_class` random images per class in val."""
    by_class = defaultdict(list)
    for idx, t in enumerate(targets):
        by_class[t].append(idx)
    train_idx, val_idx = [], []
    for t in sorted(by_class):
        idxs = by_class[t]
        random.shuffle(idxs)
        val_idx.extend(idxs[:per_class])
        train_idx.extend(idxs[per_class:])
    return sorted(train_idx), sorted(val_idx)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    c = torch.zeros(3, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
        top5 = out.topk(5, 1).indices
        c[0] += (top5[:, 0] == y).sum()
        c[1] += (top5 == y[:, None]).any(1).sum()
        c[2] += y.numel()
    dist.all_reduce(c)
    return (100 * c[0] / c[2]).item(), (100 * c[1] / c[2]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    # different seed per rank so mixup / drop-path draws differ between GPUs
    fix_seeds(args.seed + rank)

    tf_train = create_transform(224, is_training=True, auto_augment="rand-m10-mstd0.5-inc1",
                                interpolation="bicubic")
    tf_val = create_transform(224, is_training=False, interpolation="bicubic", crop_pct=0.875)
    full_train = datasets.ImageFolder(args.root, tf_train)
    full_val = datasets.ImageFolder(args.root, tf_val)  # same files, eval transform
    num_classes = len(full_train.classes)

    train_idx, val_idx = holdout_split(full_train.targets, args.holdout_per_class)
    train_set = Subset(full_train, train_idx)
    val_set = Subset(full_val, val_idx[rank::world])
    if rank == 0:
        print(f"{num_classes} classes, {len(train_idx)} train / {len(val_idx)} held-out images", flush=True)

    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=256, num_workers=args.workers, pin_memory=True)

    model = timm.create_model(args.model, num_classes=num_classes, drop_path_rate=args.drop_path)
    model.to(device)
    model = DDP(model, device_ids=[local_rank])
    model_without_ddp = model.module
    ema = ModelEmaV2(model_without_ddp, decay=args.ema_decay)

    lr = args.lr * args.batch_size * world / 4096
    optimizer = create_optimizer_v2(model_without_ddp, opt="adamw", lr=lr, weight_decay=args.wd,
                                    betas=(0.9, 0.999))
    steps = len(train_loader)
    scheduler = CosineLRScheduler(optimizer, t_initial=args.epochs * steps, warmup_t=args.warmup_epochs * steps,
                                  warmup_lr_init=1e-6, lr_min=1e-5, t_in_epochs=False)
    loss_scaler = NativeScaler()
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, switch_prob=0.5, label_smoothing=0.1,
                  num_classes=num_classes)
    criterion = SoftTargetCrossEntropy()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "classes.json"), "w") as f:
            json.dump(full_train.classes, f)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x, y = mixup(x, y)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss_scaler(loss, optimizer, clip_grad=1.0, parameters=model.parameters())
            scheduler.step_update(epoch * steps + it + 1)
            ema.update(model_without_ddp)
            if rank == 0 and it % 500 == 0:
                print(f"[{epoch}:{it}/{steps}] loss {loss.item():.4f} lr {optimizer.param_groups[0]['lr']:.2e}",
                      flush=True)

        top1, top5 = evaluate(model_without_ddp, val_loader, device)
        ema1, ema5 = evaluate(ema.module, val_loader, device)
        if rank == 0:
            best = max(best, top1, ema1)
            rec = dict(epoch=epoch, top1=top1, top5=top5, ema_top1=ema1, ema_top5=ema5, best=best,
                       minutes=(time.time() - t0) / 60)
            print(json.dumps(rec), flush=True)
            with open(os.path.join(args.out, "log.jsonl"), "a") as f:
                f.write(json.dumps(rec) + "\n")
            torch.save({"model": model_without_ddp.state_dict(), "ema": ema.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "scaler": loss_scaler.state_dict(),
                        "epoch": epoch, "val_idx": val_idx}, os.path.join(args.out, "checkpoint.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
