"""
EuroSAT land-cover classification (10 classes, 64x64 Sentinel-2 RGB) with ConvNeXt-Tiny from timm.

    torchrun --nproc_per_node=4 17_eurosat_convnext.py --data_dir data/EuroSAT_RGB --epochs 30
"""
import argparse
import os
import random
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from tqdm import tqdm


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data_dir", default="data/EuroSAT_RGB")
    parser.add_argument("--model", default="convnext_tiny.fb_in22k")
    parser.add_argument("--img_size", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--val_frac", type=float, default=0.15)
    parser.add_argument("--save", default="eurosat_convnext_best.pth")
    parser.add_argument("--seed", type=int, default=3)
    return parser.parse_args()


def fix_seeds(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def make_splits(data_dir, img_size, val_frac, seed):
    mean, std = [0.344, 0.380, 0.408], [0.203, 0.137, 0.116]
    train_tf = transforms.Compose([
        transforms.Resize(img_size),
        transforms.RandomHorizontalFlip(),
        transforms.RandomVerticalFlip(),
        transforms.RandomApply([transforms.RandomRotation(90)], p=0.5),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    eval_tf = transforms.Compose([transforms.Resize(img_size), transforms.ToTensor(), transforms.Normalize(mean, std)])

    full_train = datasets.ImageFolder(data_dir, transform=train_tf)
    full_eval = datasets.ImageFolder(data_dir, transform=eval_tf)
    # same permutation on every rank because the seed is fixed
    perm = np.random.RandomState(seed).permutation(len(full_train))
    n_val = int(len(perm) * val_frac)
    return Subset(full_train, perm[n_val:].tolist()), Subset(full_eval, perm[:n_val].tolist()), full_train.classes


def evaluate(model, loader, device):
    model.eval()
    criterion = nn.CrossEntropyLoss(reduction="sum")
    totals = torch.zeros(3, device=device)
    with torch.no_grad():
        for images, labels in loader:
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            out = model(images)
            totals[0] += criterion(out, labels)
            totals[1] += (out.argmax(1) == labels).sum()
            totals[2] += labels.size(0)
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def main():
    args = get_args()
    fix_seeds(args.seed)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_set, val_set, classes = make_splits(args.data_dir, args.img_size, args.val_frac, args.seed)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=8, pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=256, shuffle=False, num_workers=4, pin_memory=True)

    model = timm.create_model(args.model, pretrained=True, num_classes=len(classes), drop_path_rate=0.1)
    model = model.to(device)
    model = DDP(model, device_ids=[local_rank])

    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr * world_size, weight_decay=0.05)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=len(train_loader))
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=(args.epochs - 1) * len(train_loader))
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[len(train_loader)])

    if rank == 0:
        print(f"classes: {classes}")
        print(f"train {len(train_set)} | val {len(val_set)} | world size {world_size}")

    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        epoch_loss = torch.zeros(2, device=device)
        for images, labels in tqdm(train_loader, disable=(rank != 0), desc=f"epoch {epoch}"):
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            epoch_loss[0] += loss.detach()
            epoch_loss[1] += 1
        dist.all_reduce(epoch_loss)

        if rank == 0:
            val_loss, val_acc = evaluate(model.module, val_loader, device)
            print(f"[{epoch:02d}] train loss {(epoch_loss[0] / epoch_loss[1]).item():.4f} "
                  f"val loss {val_loss:.4f} val acc {val_acc:.4f} ({time.time() - t0:.0f}s)")
            if val_acc > best_acc:
                best_acc = val_acc
                torch.save({"state_dict": model.module.state_dict(), "classes": classes, "epoch": epoch},
                           args.save)
                print("  -> new best, checkpoint saved")

    if rank == 0:
        print(f"best val acc: {best_acc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
