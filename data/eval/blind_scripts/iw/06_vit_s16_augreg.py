#!/usr/bin/env python3
"""ViT-S/16 "How to train your ViT" (AugReg) recipe on ImageNet-1k, PyTorch port.

Medium augmentation: RandAugment(2, 15) + mixup 0.5, weight decay 0.1, batch 4096,
300 epochs, top-1 is averaged over the whole validation set across all ranks.
"""
import argparse
import json
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import datasets, transforms

import timm
from timm.data import Mixup
from timm.data.auto_augment import rand_augment_transform
from timm.utils import ModelEmaV2

MEAN, STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)


def cli():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", default="/data/ILSVRC2012")
    ap.add_argument("--arch", default="vit_small_patch16_224")
    ap.add_argument("--global-batch", type=int, default=4096)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=10000, help="warmup steps")
    ap.add_argument("--mixup", type=float, default=0.5)
    ap.add_argument("--ra-n", type=int, default=2)
    ap.add_argument("--ra-m", type=int, default=15)
    ap.add_argument("--ema", type=float, default=0.0, help="0 disables EMA")
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--save-dir", default="runs/vit_s16_augreg")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_transforms(args):
    ra = rand_augment_transform(f"rand-n{args.ra_n}-m{args.ra_m}-mstd0.5",
                                {"translate_const": 100, "img_mean": (128, 128, 128)})
    train = transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.05, 1.0),
                                     interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.RandomHorizontalFlip(),
        ra,
        transforms.ToTensor(),
        transforms.Normalize(MEAN, STD),
    ])
    val = transforms.Compose([
        transforms.Resize(256, interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.CenterCrop(224),
        transforms.ToTensor(),
        transforms.Normalize(MEAN, STD),
    ])
    return train, val


def lr_at(step, total, warmup, peak):
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1 + math.cos(math.pi * t))


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    correct, total = 0, 0
    for x, y in loader:
        x = x.cuda(non_blocking=True)
        y = y.cuda(non_blocking=True)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            logits = model(x)
        correct += (logits.argmax(dim=1) == y).sum().item()
        total += y.size(0)
    counts = torch.tensor([correct, total], dtype=torch.float64)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    return 100.0 * counts[0].item() / counts[1].item()


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert args.global_batch % world == 0, "global batch must divide across GPUs"
    per_gpu = args.global_batch // world
    seed_all(args.seed + rank)

    train_tf, val_tf = build_transforms(args)
    train_ds = datasets.ImageFolder(os.path.join(args.data_dir, "train"), train_tf)
    val_ds = datasets.ImageFolder(os.path.join(args.data_dir, "val"), val_tf)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    val_part = torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world))
    train_dl = DataLoader(train_ds, batch_size=per_gpu, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True, prefetch_factor=4)
    val_dl = DataLoader(val_part, batch_size=256, num_workers=args.workers, pin_memory=True)

    model = timm.create_model(args.arch, num_classes=1000, class_token=True, global_pool="token")
    nn.init.zeros_(model.head.weight)
    nn.init.constant_(model.head.bias, -math.log(1000))
    model.cuda()
    ddp_model = DDP(model, device_ids=[local_rank], static_graph=True)
    ema = ModelEmaV2(model, decay=args.ema) if args.ema > 0 else None

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "pos_embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "pos_embed" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.999))
    mix = Mixup(mixup_alpha=args.mixup, cutmix_alpha=0.0, num_classes=1000, label_smoothing=0.0)
    bce = nn.BCEWithLogitsLoss()  # sigmoid cross-entropy, as in big_vision

    steps_per_epoch = len(train_dl)
    total_steps = steps_per_epoch * args.epochs
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        print(f"{world} GPUs x {per_gpu} = {per_gpu * world} per step, {total_steps} steps")

    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        ddp_model.train()
        tic = time.time()
        for x, y in train_dl:
            x = x.cuda(non_blocking=True)
            y = y.cuda(non_blocking=True)
            x, y_soft = mix(x, y)
            lr = lr_at(step, total_steps, args.warmup, args.lr)
            for g in opt.param_groups:
                g["lr"] = lr
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                logits = ddp_model(x)
            loss = bce(logits.float(), y_soft)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(ddp_model.parameters(), 1.0)
            opt.step()
            if ema is not None:
                ema.update(model)
            step += 1
            if rank == 0 and step % 200 == 0:
                print(f"[{epoch}] step {step}/{total_steps} loss {loss.item():.4f} lr {lr:.2e} "
                      f"{(time.time() - tic):.0f}s", flush=True)

        if epoch % 5 == 4 or epoch == args.epochs - 1:
            top1 = evaluate(model, val_dl)
            ema_top1 = evaluate(ema.module, val_dl) if ema is not None else None
            if rank == 0:
                rec = {"epoch": epoch, "step": step, "top1": top1, "ema_top1": ema_top1}
                print(json.dumps(rec), flush=True)
                with open(os.path.join(args.save_dir, "metrics.jsonl"), "a") as f:
                    f.write(json.dumps(rec) + "\n")
                torch.save({"model": model.state_dict(),
                            "ema": ema.module.state_dict() if ema is not None else None,
                            "opt": opt.state_dict(), "epoch": epoch, "step": step},
                           os.path.join(args.save_dir, "last.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
