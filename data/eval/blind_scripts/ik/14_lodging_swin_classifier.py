# -*- coding: utf-8 -*-
"""
Lodging assessment of rice / wheat plots from UAV RGB mosaics.

Each plot crop gets one of four lodging grades (none, light, moderate, severe)
from the breeders' field notes. Swin-T backbone, strong geometric augmentation
because the plots are photographed from many headings.

Usage:
    torchrun --nproc_per_node=4 14_lodging_swin_classifier.py --data-dir /data/lodging --epochs 50
"""
import os
import sys
import time
import json
import random
import argparse

import numpy as np
import torch
import torch.nn as nn
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
import timm
from timm.utils import AverageMeter, accuracy


def get_parser():
    parser = argparse.ArgumentParser("lodging grade classifier")
    parser.add_argument("--data-dir", type=str, required=True, help="ImageFolder layout: train/<grade>, val/<grade>")
    parser.add_argument("--model", type=str, default="swin_tiny_patch4_window7_224")
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=48)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--min-lr", type=float, default=1e-6)
    parser.add_argument("--warmup-epochs", type=int, default=3)
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--num-workers", type=int, default=8)
    parser.add_argument("--output", type=str, default="output/lodging")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_loaders(args, world_size, rank):
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.3, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.RandomVerticalFlip(),
        transforms.RandomRotation(180),
        transforms.ColorJitter(0.4, 0.4, 0.4, 0.05),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
        transforms.RandomErasing(p=0.2),
    ])
    val_tf = transforms.Compose([
        transforms.Resize(256),
        transforms.CenterCrop(224),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    train_set = datasets.ImageFolder(os.path.join(args.data_dir, "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data_dir, "val"), val_tf)
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    val_indices = list(range(rank, len(val_set), world_size))
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, val_indices), batch_size=args.batch_size * 2,
                            shuffle=False, num_workers=args.num_workers, pin_memory=True)
    return train_set, train_loader, train_sampler, val_loader


def adjust_lr(optimizer, epoch_float, args):
    if epoch_float < args.warmup_epochs:
        lr = args.lr * epoch_float / args.warmup_epochs
    else:
        t = (epoch_float - args.warmup_epochs) / (args.epochs - args.warmup_epochs)
        lr = args.min_lr + (args.lr - args.min_lr) * 0.5 * (1.0 + np.cos(np.pi * t))
    for g in optimizer.param_groups:
        g["lr"] = lr
    return lr


def train_one_epoch(model, loader, criterion, optimizer, scaler, epoch, args, device):
    model.train()
    loss_meter = AverageMeter()
    n = len(loader)
    for i, (images, target) in enumerate(loader):
        lr = adjust_lr(optimizer, epoch + i / n, args)
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():
            output = model(images)
            loss = criterion(output, target)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        scaler.step(optimizer)
        scaler.update()
        loss_meter.update(loss.item(), images.size(0))
    t = torch.tensor([loss_meter.sum, loss_meter.count], device=device)
    dist.all_reduce(t)
    return (t[0] / t[1]).item(), lr


@torch.no_grad()
def validate(model, loader, device, num_classes):
    model.eval()
    stats = torch.zeros(2 + num_classes * num_classes, device=device)
    for images, target in loader:
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():
            output = model(images)
        pred = output.argmax(1)
        stats[0] += (pred == target).sum()
        stats[1] += target.numel()
        stats[2:] += torch.bincount(target * num_classes + pred, minlength=num_classes ** 2).float()
    dist.all_reduce(stats)
    cm = stats[2:].view(num_classes, num_classes)
    recall = cm.diag() / cm.sum(1).clamp(min=1)
    return (stats[0] / stats[1]).item(), recall.mean().item(), cm.long().tolist()


def main():
    args = get_parser().parse_args()
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank)
    set_seed(args.seed + rank)

    train_set, train_loader, train_sampler, val_loader = build_loaders(args, world_size, rank)
    num_classes = len(train_set.classes)

    model = timm.create_model(args.model, pretrained=True, num_classes=num_classes, drop_path_rate=0.2)
    model.to(device)
    model = DistributedDataParallel(model, device_ids=[args.local_rank])
    model_without_ddp = model.module

    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        print(f"classes: {train_set.classes}  train: {len(train_set)}  world size: {world_size}")
        sys.stdout.flush()

    best_recall = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        train_loss, lr = train_one_epoch(model, train_loader, criterion, optimizer, scaler, epoch, args, device)
        acc, mrecall, cm = validate(model_without_ddp, val_loader, device, num_classes)
        if rank == 0:
            log = {"epoch": epoch, "train_loss": round(train_loss, 4), "lr": lr, "val_acc": round(acc, 4),
                   "val_mean_recall": round(mrecall, 4), "time": round(time.time() - t0)}
            print(json.dumps(log))
            sys.stdout.flush()
            with open(os.path.join(args.output, "log.txt"), "a") as f:
                f.write(json.dumps(log) + "\n")
            if mrecall > best_recall:
                best_recall = mrecall
                torch.save({"model": model_without_ddp.state_dict(), "classes": train_set.classes,
                            "epoch": epoch, "confusion": cm}, os.path.join(args.output, "best.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
