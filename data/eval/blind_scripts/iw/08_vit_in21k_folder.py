#!/usr/bin/env python3
"""ViT-L/16 pre-training on ImageNet-21k (processed "fall11" folder tree, 11k classes).

Listing 11M files over Lustre takes ~20 minutes, so the (path, label) list is cached
as a pickle next to the dataset and reused by later runs.
"""
import argparse
import json
import math
import os
import pickle
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import timm
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from timm.utils import ModelEmaV2


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/lustre/datasets/imagenet21k_resized/imagenet21k_train")
    ap.add_argument("--val-root", default="/lustre/datasets/imagenet21k_resized/imagenet21k_val")
    ap.add_argument("--cache", default="/lustre/datasets/imagenet21k_resized/.index_cache")
    ap.add_argument("--model", default="vit_large_patch16_224")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--lr", type=float, default=3e-4, help="per 1024 images")
    ap.add_argument("--wd", type=float, default=0.05)
    ap.add_argument("--warmup-epochs", type=int, default=5)
    ap.add_argument("--label-smoothing", type=float, default=0.2)
    ap.add_argument("--ema-decay", type=float, default=0.9998)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--out", default="/lustre/runs/vit_l16_in21k")
    ap.add_argument("--resume", default="")
    return ap.parse_args()


def list_images(root, cache_dir, split):
    cache_file = os.path.join(cache_dir, f"{split}_index.pkl")
    if os.path.isfile(cache_file):
        with open(cache_file, "rb") as f:
            return pickle.load(f)

    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    class_to_idx = {c: i for i, c in enumerate(classes)}
    samples = []
    for c in classes:
        d = os.path.join(root, c)
        for e in os.scandir(d):
            if e.name.endswith((".JPEG", ".jpg", ".jpeg", ".png")):
                samples.append((os.path.join(d, e.name), class_to_idx[c]))
    index = {"classes": classes, "samples": samples}
    os.makedirs(cache_dir, exist_ok=True)
    with open(cache_file, "wb") as f:
        pickle.dump(index, f, protocol=pickle.HIGHEST_PROTOCOL)
    return index


class ListDataset(Dataset):
    def __init__(self, samples, transform):
        self.samples = samples
        self.transform = transform

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        path, label = self.samples[idx]
        with open(path, "rb") as f:
            img = Image.open(f).convert("RGB")
        return self.transform(img), label


def cosine_with_warmup(optimizer, base_lr, step, total, warmup):
    if step < warmup:
        lr = base_lr * (step + 1) / warmup
    else:
        lr = 1e-6 + (base_lr - 1e-6) * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))
    for g in optimizer.param_groups:
        g["lr"] = lr
    return lr


@torch.no_grad()
def top1(model, loader, device):
    model.eval()
    hits = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(x).argmax(1)
        hits[0] += (pred == y).sum()
        hits[1] += y.numel()
    dist.all_reduce(hits)
    return (100 * hits[0] / hits[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    train_index = list_images(args.root, args.cache, "train")
    val_index = list_images(args.val_root, args.cache, "val")
    num_classes = len(train_index["classes"])
    assert train_index["classes"] == val_index["classes"]

    tf_train = create_transform(224, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                                interpolation="bicubic", re_prob=0.0)
    tf_val = create_transform(224, is_training=False, interpolation="bicubic", crop_pct=0.875)
    train_set = ListDataset(train_index["samples"], tf_train)
    val_set = ListDataset(val_index["samples"][rank::world], tf_val)

    sampler = DistributedSampler(train_set, shuffle=True, seed=0, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True, prefetch_factor=4)
    val_loader = DataLoader(val_set, batch_size=128, num_workers=8, pin_memory=True)

    model = timm.create_model(args.model, num_classes=num_classes, drop_path_rate=0.1).to(dev)
    ddp = DDP(model, device_ids=[local_rank])
    ema = ModelEmaV2(model, decay=args.ema_decay)

    base_lr = args.lr * args.batch_size * world / 1024
    params_wd = [p for n, p in model.named_parameters() if p.ndim > 1 and "pos_embed" not in n]
    params_no = [p for n, p in model.named_parameters() if p.ndim <= 1 or "pos_embed" in n]
    optimizer = torch.optim.AdamW([{"params": params_wd, "weight_decay": args.wd},
                                   {"params": params_no, "weight_decay": 0.0}], lr=base_lr)
    scaler = torch.cuda.amp.GradScaler()
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=args.label_smoothing,
                  num_classes=num_classes)
    criterion = SoftTargetCrossEntropy()

    steps_per_epoch = len(train_loader)
    total = steps_per_epoch * args.epochs
    warmup = steps_per_epoch * args.warmup_epochs
    start_epoch = 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ck["model"])
        ema.module.load_state_dict(ck["ema"])
        optimizer.load_state_dict(ck["optimizer"])
        scaler.load_state_dict(ck["scaler"])
        start_epoch = ck["epoch"] + 1
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(train_set)} train images, {num_classes} classes, {world} ranks, lr {base_lr:.2e}")

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_loader):
            step = epoch * steps_per_epoch + i
            lr = cosine_with_warmup(optimizer, base_lr, step, total, warmup)
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            x, y = mixup(x, y)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(ddp(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            ema.update(model)
            if rank == 0 and i % 500 == 0:
                print(f"epoch {epoch} iter {i}/{steps_per_epoch} loss {loss.item():.4f} lr {lr:.2e}",
                      flush=True)

        acc = top1(model, val_loader, dev)
        acc_ema = top1(ema.module, val_loader, dev)
        if rank == 0:
            print(json.dumps({"epoch": epoch, "top1": acc, "ema_top1": acc_ema,
                              "minutes": (time.time() - t0) / 60}), flush=True)
            torch.save({"model": model.state_dict(), "ema": ema.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
                        "epoch": epoch}, os.path.join(args.out, "checkpoint.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
