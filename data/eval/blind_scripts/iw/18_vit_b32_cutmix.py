#!/usr/bin/env python3
"""ViT-B/32 on ImageNet-1k, 300 epochs, CutMix + Mixup, RandAugment, EMA, top-1/top-5 over all ranks."""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torchvision import datasets

import timm
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import CosineLRScheduler
from timm.utils import AverageMeter, ModelEmaV2, accuracy


def parse_args():
    parser = argparse.ArgumentParser(description="ViT-B/32 ImageNet training")
    parser.add_argument("--data", default="/data/imagenet", help="path to dataset")
    parser.add_argument("--arch", default="vit_base_patch32_224")
    parser.add_argument("--epochs", default=300, type=int)
    parser.add_argument("--batch-size", default=256, type=int, help="per-GPU batch size")
    parser.add_argument("--lr", default=1e-3, type=float, help="lr for a global batch of 1024")
    parser.add_argument("--weight-decay", default=0.05, type=float)
    parser.add_argument("--warmup-epochs", default=10, type=int)
    parser.add_argument("--mixup", default=0.8, type=float)
    parser.add_argument("--cutmix", default=1.0, type=float)
    parser.add_argument("--smoothing", default=0.1, type=float)
    parser.add_argument("--drop-path", default=0.1, type=float)
    parser.add_argument("--ema-decay", default=0.99996, type=float)
    parser.add_argument("-j", "--workers", default=12, type=int)
    parser.add_argument("--output", default="./checkpoints/vit_b32")
    parser.add_argument("--resume", default="", type=str)
    parser.add_argument("--local_rank", default=0, type=int)
    return parser.parse_args()


def train_epoch(model, loader, criterion, optimizer, scheduler, scaler, mixup_fn, ema, epoch, args):
    model.train()
    losses = AverageMeter()
    n = len(loader)
    end = time.time()
    for i, (images, target) in enumerate(loader):
        images = images.cuda(non_blocking=True)
        target = target.cuda(non_blocking=True)
        images, target = mixup_fn(images, target)
        with torch.cuda.amp.autocast():
            output = model(images)
            loss = criterion(output, target)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step_update(epoch * n + i + 1)
        ema.update(model.module)
        losses.update(loss.item(), images.size(0))
        if dist.get_rank() == 0 and i % 100 == 0:
            print(f"Epoch: [{epoch}][{i}/{n}] loss {losses.val:.4f} ({losses.avg:.4f}) "
                  f"lr {optimizer.param_groups[0]['lr']:.3e} time {time.time() - end:.1f}s", flush=True)
    return losses.avg


@torch.no_grad()
def validate(model, loader):
    model.eval()
    buf = torch.zeros(3, dtype=torch.float64, device="cuda")
    for images, target in loader:
        images = images.cuda(non_blocking=True)
        target = target.cuda(non_blocking=True)
        with torch.cuda.amp.autocast():
            output = model(images)
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        bs = target.size(0)
        buf[0] += acc1.double() * bs / 100
        buf[1] += acc5.double() * bs / 100
        buf[2] += bs
    dist.all_reduce(buf)
    return (100 * buf[0] / buf[2]).item(), (100 * buf[1] / buf[2]).item()


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    torch.backends.cudnn.benchmark = True

    train_tf = create_transform(224, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                                interpolation="bicubic", re_prob=0.25)
    val_tf = create_transform(224, is_training=False, interpolation="bicubic", crop_pct=0.875)
    train_dataset = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_dataset = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset)
    val_subset = torch.utils.data.Subset(val_dataset, range(rank, len(val_dataset), world_size))
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler,
                                               num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = torch.utils.data.DataLoader(val_subset, batch_size=args.batch_size, shuffle=False,
                                             num_workers=args.workers, pin_memory=True)

    model = timm.create_model(args.arch, num_classes=1000, drop_path_rate=args.drop_path)
    model.cuda()
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    ema = ModelEmaV2(model.module, decay=args.ema_decay)

    lr = args.lr * args.batch_size * world_size / 1024
    optimizer = create_optimizer_v2(model.module, opt="adamw", lr=lr, weight_decay=args.weight_decay)
    n_iter = len(train_loader)
    scheduler = CosineLRScheduler(optimizer, t_initial=args.epochs * n_iter, lr_min=1e-5,
                                  warmup_t=args.warmup_epochs * n_iter, warmup_lr_init=1e-6, t_in_epochs=False)
    scaler = torch.cuda.amp.GradScaler()
    mixup_fn = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=args.smoothing,
                     num_classes=1000)
    criterion = SoftTargetCrossEntropy().cuda()

    start_epoch, best_acc1 = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        ema.module.load_state_dict(ckpt["ema"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_acc1 = ckpt["epoch"] + 1, ckpt["best_acc1"]

    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        train_loss = train_epoch(model, train_loader, criterion, optimizer, scheduler, scaler, mixup_fn,
                                 ema, epoch, args)
        acc1, acc5 = validate(model.module, val_loader)
        ema_acc1, _ = validate(ema.module, val_loader)
        best_acc1 = max(best_acc1, acc1, ema_acc1)
        if rank == 0:
            rec = {"epoch": epoch, "train_loss": train_loss, "acc1": acc1, "acc5": acc5,
                   "ema_acc1": ema_acc1, "best_acc1": best_acc1}
            print(json.dumps(rec), flush=True)
            with open(os.path.join(args.output, "log.jsonl"), "a") as f:
                f.write(json.dumps(rec) + "\n")
            torch.save({"model": model.module.state_dict(), "ema": ema.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
                        "epoch": epoch, "best_acc1": best_acc1}, os.path.join(args.output, "checkpoint.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
