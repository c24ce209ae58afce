#!/usr/bin/env python3
"""ConvNeXt-T / LAMB, 8k global batch, with auto-resume for preemptible nodes.

The scheduler requeues the job after preemption; the script picks up the newest
checkpoint in --output on its own.

    torchrun --nproc_per_node=8 07_convnext_lamb_autoresume.py --output /shared/ckpt/cnxt_t_lamb
"""
import argparse
import glob
import math
import os
import re
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import timm
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from timm.optim import Lamb
from timm.utils import ModelEmaV2
from torchvision.datasets import ImageFolder


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/shared/datasets/imagenet")
    p.add_argument("--output", required=True)
    p.add_argument("--model", default="convnext_tiny")
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--update-freq", type=int, default=8)
    p.add_argument("--blr", type=float, default=4e-3, help="lr per 4096 images")
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--warmup-epochs", type=int, default=20)
    p.add_argument("--drop-path", type=float, default=0.1)
    p.add_argument("--ema-decay", type=float, default=0.9999)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--workers", type=int, default=10)
    return p


def find_latest(output):
    ckpts = glob.glob(os.path.join(output, "checkpoint-*.pth"))
    if not ckpts:
        return None
    return max(ckpts, key=lambda p: int(re.search(r"checkpoint-(\d+)\.pth", p).group(1)))


def prune(output, keep):
    ckpts = sorted(glob.glob(os.path.join(output, "checkpoint-*.pth")),
                   key=lambda p: int(re.search(r"checkpoint-(\d+)\.pth", p).group(1)))
    for old in ckpts[:-keep]:
        os.remove(old)


def lr_for(update, total, warmup, peak):
    if update < warmup:
        return peak * update / warmup
    return 0.5 * peak * (1 + math.cos(math.pi * (update - warmup) / (total - warmup)))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = torch.zeros(1, device=device)
    seen = torch.zeros(1, device=device)
    for x, y in loader:
        x = x.to(device, non_blocking=True).to(memory_format=torch.channels_last)
        y = y.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():
            logits = model(x)
        correct += (logits.argmax(-1) == y).sum()
        seen += y.size(0)
    dist.all_reduce(correct)
    dist.all_reduce(seen)
    return (correct / seen * 100).item()


def main():
    args = get_parser().parse_args()
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_set = ImageFolder(os.path.join(args.data, "train"),
                            create_transform(224, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                                             re_prob=0.25, interpolation="bicubic"))
    val_set = ImageFolder(os.path.join(args.data, "val"),
                          create_transform(224, is_training=False, crop_pct=0.875,
                                           interpolation="bicubic"))
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=0, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=2 * args.batch_size, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    model = timm.create_model(args.model, num_classes=1000, drop_path_rate=args.drop_path)
    model.to(device, memory_format=torch.channels_last)
    model = DDP(model, device_ids=[local_rank])
    ema = ModelEmaV2(model.module, decay=args.ema_decay)

    eff_batch = args.batch_size * args.update_freq * world
    peak_lr = args.blr * eff_batch / 4096
    decay = [p for n, p in model.module.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.module.named_parameters() if p.ndim <= 1]
    optimizer = Lamb([{"params": decay, "weight_decay": args.weight_decay},
                      {"params": no_decay, "weight_decay": 0.0}], lr=peak_lr)
    scaler = torch.cuda.amp.GradScaler()
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=1000)
    criterion = SoftTargetCrossEntropy()

    start_epoch = 0
    latest = find_latest(args.output)
    if latest is not None:
        checkpoint = torch.load(latest)
        model.module.load_state_dict(checkpoint["model"])
        ema.module.load_state_dict(checkpoint["model_ema"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scaler.load_state_dict(checkpoint["scaler"])
        start_epoch = checkpoint["epoch"] + 1
        if rank == 0:
            print(f"resumed from {latest} at epoch {start_epoch}", flush=True)

    updates_per_epoch = len(train_loader) // args.update_freq
    total_updates = args.epochs * updates_per_epoch
    warmup_updates = args.warmup_epochs * updates_per_epoch
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        optimizer.zero_grad(set_to_none=True)
        t_start = time.time()
        for it, (x, y) in enumerate(train_loader):
            x = x.to(device, non_blocking=True).to(memory_format=torch.channels_last)
            y = y.to(device, non_blocking=True)
            x, y = mixup(x, y)
            boundary = (it + 1) % args.update_freq == 0
            with (torch.enable_grad() if boundary else model.no_sync()):
                with torch.cuda.amp.autocast():
                    loss = criterion(model(x), y) / args.update_freq
                scaler.scale(loss).backward()
            if boundary:
                update = epoch * updates_per_epoch + it // args.update_freq
                for g in optimizer.param_groups:
                    g["lr"] = lr_for(update, total_updates, warmup_updates, peak_lr)
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                ema.update(model.module)

            if rank == 0 and it % 400 == 0:
                elapsed = time.time() - t_start
                print(f"epoch {epoch} it {it}/{len(train_loader)} "
                      f"loss {loss.item() * args.update_freq:.4f} "
                      f"{(it + 1) * args.batch_size * world / elapsed:.0f} img/s", flush=True)

        acc = evaluate(model, val_loader, device)
        acc_ema = evaluate(ema.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} acc {acc:.2f} ema {acc_ema:.2f} ({time.time() - t_start:.0f}s)",
                  flush=True)
            if (epoch + 1) % args.save_every == 0 or epoch + 1 == args.epochs:
                torch.save({"epoch": epoch, "model": model.module.state_dict(),
                            "model_ema": ema.module.state_dict(),
                            "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
                            "args": vars(args)},
                           os.path.join(args.output, f"checkpoint-{epoch}.pth"))
                prune(args.output, args.keep)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
