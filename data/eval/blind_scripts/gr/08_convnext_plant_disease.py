#!/usr/bin/env python3
"""
Plant disease classification (one folder per class, no official val split).
ConvNeXt-Tiny, ImageNet-pretrained, fine-tuned with DistributedDataParallel.

Launch:
    torchrun --nproc_per_node=2 08_convnext_plant_disease.py --root /data/plant_village --epochs 20
"""
import argparse
import json
import os
import random
import time
from datetime import datetime

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, random_split
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from torchvision.datasets import ImageFolder
from torchvision.models import ConvNeXt_Tiny_Weights, convnext_tiny
from tqdm import tqdm


def parse_args():
    parser = argparse.ArgumentParser(description="ConvNeXt plant disease (DDP)")
    parser.add_argument("--root", required=True)
    parser.add_argument("--val-split", type=float, default=0.15)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=48)
    parser.add_argument("--lr", type=float, default=2e-4, help="peak LR, tuned for 2 GPUs x 48")
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--output", default="outputs/plant_convnext")
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def setup_distributed():
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    return rank, local_rank, world_size


def cleanup():
    dist.destroy_process_group()


def is_main_process():
    return dist.get_rank() == 0


def print_rank0(*args):
    if is_main_process():
        print(f"[{datetime.now():%H:%M:%S}]", *args, flush=True)


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def make_datasets(root, val_split):
    weights = ConvNeXt_Tiny_Weights.IMAGENET1K_V1
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.5, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.RandomVerticalFlip(),
        transforms.ColorJitter(0.2, 0.2, 0.2),
        transforms.ToTensor(),
        transforms.Normalize(weights.transforms().mean, weights.transforms().std),
    ])
    eval_tf = weights.transforms()

    # two views of the same folder so train/val can have different transforms
    train_full = ImageFolder(root, transform=train_tf)
    eval_full = ImageFolder(root, transform=eval_tf)

    n_val = int(len(train_full) * val_split)
    n_train = len(train_full) - n_val
    train_idx, val_idx = random_split(range(len(train_full)), [n_train, n_val])
    return (Subset(train_full, list(train_idx)), Subset(eval_full, list(val_idx)),
            train_full.classes)


def train_epoch(model, loader, optimizer, scheduler, criterion, device, epoch):
    model.train()
    total_loss = torch.zeros(1, device=device)
    steps = 0
    for images, labels in tqdm(loader, disable=not is_main_process(), desc=f"train {epoch}"):
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = criterion(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        total_loss += loss.detach()
        steps += 1
    dist.all_reduce(total_loss)
    return total_loss.item() / (steps * dist.get_world_size())


@torch.no_grad()
def evaluate(model, loader, device, num_classes):
    model.eval()
    confusion = torch.zeros(num_classes, num_classes, dtype=torch.long, device=device)
    for images, labels in loader:
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            preds = model(images).argmax(dim=1)
        idx = labels * num_classes + preds
        confusion += torch.bincount(idx, minlength=num_classes ** 2).view(num_classes, num_classes)
    dist.all_reduce(confusion)
    acc = confusion.diag().sum().item() / confusion.sum().item()
    per_class = confusion.diag().float() / confusion.sum(1).clamp(min=1).float()
    return acc, per_class.mean().item()


def main():
    args = parse_args()
    rank, local_rank, world_size = setup_distributed()
    device = torch.device(f"cuda:{local_rank}")
    # different seed per rank -> different augmentation streams per GPU
    seed_everything(args.seed + rank)

    train_ds, val_ds, classes = make_datasets(args.root, args.val_split)
    num_classes = len(classes)
    print_rank0(f"{num_classes} classes, {len(train_ds)} train / {len(val_ds)} val images")

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=96, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    model = convnext_tiny(weights=ConvNeXt_Tiny_Weights.IMAGENET1K_V1)
    model.classifier[2] = nn.Linear(model.classifier[2].in_features, num_classes)
    model = model.to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.lr, total_steps=args.epochs * len(train_loader), pct_start=0.05)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    if is_main_process():
        os.makedirs(args.output, exist_ok=True)
        with open(os.path.join(args.output, "classes.json"), "w") as f:
            json.dump(classes, f)

    best_acc = 0.0
    history = []
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        train_loss = train_epoch(model, train_loader, optimizer, scheduler, criterion, device, epoch)
        acc, bal_acc = evaluate(model, val_loader, device, num_classes)
        print_rank0(f"epoch {epoch:2d} loss {train_loss:.4f} acc {acc:.4f} "
                    f"balanced {bal_acc:.4f} ({time.time() - t0:.0f}s)")
        history.append({"epoch": epoch, "train_loss": train_loss, "acc": acc, "balanced_acc": bal_acc})

        if is_main_process():
            if acc > best_acc:
                best_acc = acc
                torch.save({"model": model.module.state_dict(), "classes": classes, "epoch": epoch},
                           os.path.join(args.output, "best.pt"))
            with open(os.path.join(args.output, "history.json"), "w") as f:
                json.dump(history, f, indent=1)
        dist.barrier()

    print_rank0(f"best val acc: {best_acc:.4f}")
    cleanup()


if __name__ == "__main__":
    main()
