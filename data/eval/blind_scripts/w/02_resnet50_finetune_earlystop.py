#!/usr/bin/env python
"""Fine-tune an ImageNet ResNet-50 on a folder dataset (train/ and val/ subfolders per class).

torchrun --standalone --nproc_per_node=8 02_resnet50_finetune_earlystop.py \
    --data /datasets/plant_disease --epochs 50 --patience 6
"""
import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, models, transforms
from tqdm import tqdm


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--output", default="checkpoints/resnet50_ft")
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=32, help="per GPU")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--weight-decay", type=float, default=1e-4)
    ap.add_argument("--patience", type=int, default=6)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--resume", default="")
    ap.add_argument("--seed", type=int, default=1234)
    return ap.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def make_transforms():
    normalize = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.5, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.ColorJitter(0.2, 0.2, 0.2),
        transforms.ToTensor(),
        normalize,
    ])
    val_tf = transforms.Compose([
        transforms.Resize(256),
        transforms.CenterCrop(224),
        transforms.ToTensor(),
        normalize,
    ])
    return train_tf, val_tf


@torch.no_grad()
def evaluate(net, loader, device):
    """Each rank evaluates its own slice; the sums are added up across ranks."""
    net.eval()
    stats = torch.zeros(3, device=device)  # loss_sum, correct, count
    crit = nn.CrossEntropyLoss(reduction="sum")
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        out = net(x)
        stats[0] += crit(out, y)
        stats[1] += (out.argmax(1) == y).sum()
        stats[2] += y.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    args = parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    seed_everything(args.seed + rank)

    train_tf, val_tf = make_transforms()
    train_ds = datasets.ImageFolder(os.path.join(args.data, "train"), transform=train_tf)
    val_ds = datasets.ImageFolder(os.path.join(args.data, "val"), transform=val_tf)
    num_classes = len(train_ds.classes)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, persistent_workers=True)

    # strided, non-padded slice of the val set per rank so no image is counted twice
    val_part = Subset(val_ds, list(range(rank, len(val_ds), world)))
    val_loader = DataLoader(val_part, batch_size=64, shuffle=False, num_workers=args.workers, pin_memory=True)

    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        print(f"{num_classes} classes | {len(train_ds)} train / {len(val_ds)} val | {world} GPUs")

    model = models.resnet50(weights=models.ResNet50_Weights.IMAGENET1K_V2)
    model.fc = nn.Linear(model.fc.in_features, num_classes)
    # per-GPU batch is only 32, keep BN statistics over the whole global batch
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    start_epoch, best_acc, bad_epochs = 0, 0.0, 0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1
        best_acc = ckpt.get("best_acc", 0.0)
        if rank == 0:
            print(f"resumed from {args.resume} at epoch {start_epoch}")

    best_path = os.path.join(args.output, "best_model.pth")

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        loss_acc = torch.zeros(2, device=device)

        for x, y in tqdm(train_loader, disable=rank != 0, desc=f"ep{epoch}", leave=False):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
            loss_acc[0] += loss.detach()
            loss_acc[1] += 1
        scheduler.step()

        dist.all_reduce(loss_acc)
        train_loss = (loss_acc[0] / loss_acc[1]).item()
        # the slices are uneven by at most one image; evaluation goes through the
        # bare module so DDP does not expect matching forwards here
        val_loss, val_acc = evaluate(model.module, val_loader, device)

        improved = val_acc > best_acc
        if improved:
            best_acc, bad_epochs = val_acc, 0
        else:
            bad_epochs += 1

        if rank == 0:
            print(f"[{epoch:03d}] train {train_loss:.4f} | val {val_loss:.4f} acc {val_acc:.4f} "
                  f"| best {best_acc:.4f} | {time.time() - tic:.0f}s")
            state = {
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "epoch": epoch,
                "best_acc": best_acc,
                "classes": train_ds.classes,
            }
            torch.save(state, os.path.join(args.output, "last.pth"))
            if improved:
                torch.save(state, best_path)

        # val_acc comes out of an all_reduce, so every rank takes the same decision here
        if bad_epochs >= args.patience:
            if rank == 0:
                print(f"early stopping: no improvement for {args.patience} epochs")
            break

    dist.barrier()  # make sure best_model.pth is fully written before anyone reads it
    ckpt = torch.load(best_path, map_location=device)
    model.module.load_state_dict(ckpt["model"])
    final_loss, final_acc = evaluate(model.module, val_loader, device)
    if rank == 0:
        print(f"best checkpoint (epoch {ckpt['epoch']}): val loss {final_loss:.4f}, acc {final_acc:.4f}")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
