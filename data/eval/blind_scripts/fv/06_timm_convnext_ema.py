#!/usr/bin/env python3
"""ConvNeXt-T training on an ImageFolder dataset with model EMA.

dist helpers follow the mmcv-style layout we used with the old
torch.distributed.launch scripts (init_dist / get_dist_info / sync_random_seed).
"""
import argparse
import os
import random
import time
from copy import deepcopy

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from timm.data import create_transform, Mixup
from timm.loss import SoftTargetCrossEntropy
from timm.utils import ModelEmaV2, accuracy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder


def init_dist(backend="nccl"):
    dist.init_process_group(backend=backend, init_method="env://")


def get_dist_info():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def sync_random_seed(seed=None, device="cuda"):
    """Make sure all ranks share the same random seed (used by samplers)."""
    if seed is None:
        seed = np.random.randint(2 ** 31)
    rank, world_size = get_dist_info()
    if world_size == 1:
        return seed
    if rank == 0:
        random_num = torch.tensor(seed, dtype=torch.int32, device=device)
    else:
        random_num = torch.tensor(0, dtype=torch.int32, device=device)
    dist.broadcast(random_num, src=0)
    return random_num.item()


def set_random_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--model", default="convnext_tiny")
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--blr", type=float, default=4e-3, help="lr for a global batch of 4096")
    p.add_argument("--min-lr", type=float, default=1e-6)
    p.add_argument("--warmup-epochs", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--drop-path", type=float, default=0.1)
    p.add_argument("--mixup", type=float, default=0.8)
    p.add_argument("--cutmix", type=float, default=1.0)
    p.add_argument("--smoothing", type=float, default=0.1)
    p.add_argument("--ema-decay", type=float, default=0.9999)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--output", default="./output")
    p.add_argument("--seed", type=int, default=None)
    return p.parse_args()


def cosine_lr(optimizer, it, total_it, warmup_it, base_lr, min_lr):
    if it < warmup_it:
        lr = base_lr * it / warmup_it
    else:
        t = (it - warmup_it) / max(1, total_it - warmup_it)
        lr = min_lr + (base_lr - min_lr) * 0.5 * (1.0 + np.cos(np.pi * t))
    for g in optimizer.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)
    return lr


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    crit = nn.CrossEntropyLoss(reduction="sum")
    stats = torch.zeros(4, device=device)
    for images, target in loader:
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(images)
        acc1, acc5 = accuracy(out, target, topk=(1, 5))
        n = images.size(0)
        stats += torch.stack([crit(out.float(), target), acc1 * n / 100, acc5 * n / 100,
                              torch.tensor(float(n), device=device)])
    dist.all_reduce(stats)
    return stats[0] / stats[3], 100 * stats[1] / stats[3], 100 * stats[2] / stats[3]


def main():
    args = parse_args()
    init_dist()
    rank, world_size = get_dist_info()
    seed = sync_random_seed(args.seed)
    set_random_seed(seed + rank)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    train_tf = create_transform(args.img_size, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                                re_prob=0.25, interpolation="bicubic")
    val_tf = create_transform(args.img_size, is_training=False, interpolation="bicubic")
    train_set = ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = ImageFolder(os.path.join(args.data, "val"), val_tf)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=seed)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, 2 * args.batch_size, sampler=val_sampler, num_workers=args.workers,
                            pin_memory=True)

    mixup_fn = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=args.smoothing,
                     num_classes=args.num_classes)
    criterion = SoftTargetCrossEntropy()

    model = timm.create_model(args.model, num_classes=args.num_classes, drop_path_rate=args.drop_path)
    model.to(device)
    model_ema = ModelEmaV2(model, decay=args.ema_decay)
    model = DDP(model, device_ids=[local_rank])

    eff_batch = args.batch_size * world_size
    lr = args.blr * eff_batch / 4096
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.weight_decay)
    scaler = torch.cuda.amp.GradScaler()
    steps_per_epoch = len(train_loader)
    total_it, warmup_it = args.epochs * steps_per_epoch, args.warmup_epochs * steps_per_epoch

    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        print(f"world={world_size} eff_batch={eff_batch} lr={lr:.2e} seed={seed}")

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (images, target) in enumerate(train_loader):
            it = epoch * steps_per_epoch + i
            cur_lr = cosine_lr(optimizer, it, total_it, warmup_it, lr, args.min_lr)
            images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
            images, target = mixup_fn(images, target)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(model(images), target)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            model_ema.update(model.module)
            if rank == 0 and i % 100 == 0:
                print(f"ep {epoch} it {i}/{steps_per_epoch} loss {loss.item():.4f} lr {cur_lr:.2e} "
                      f"{time.time() - t0:.0f}s")

        _, top1, top5 = evaluate(model, val_loader, device)
        _, ema_top1, _ = evaluate(model_ema.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: top1 {top1:.2f} top5 {top5:.2f} ema top1 {ema_top1:.2f}")
            state = {"model": model.module.state_dict(), "model_ema": model_ema.module.state_dict(),
                     "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(), "epoch": epoch}
            torch.save(state, os.path.join(args.output, "last.pth"))
            if max(top1, ema_top1) > best:
                best = max(top1, ema_top1).item()
                torch.save(state, os.path.join(args.output, "best.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
