#!/usr/bin/env python3
"""ViT-B/16 pre-training on ImageNet-21k (fall11, 21841 classes) from WebDataset tar shards.

AugReg-style recipe: RandAugment + mixup, AdamW, 90 epochs, cosine schedule.
Shards: imagenet21k-train-{000000..010239}.tar with jpg + cls entries.
"""
import argparse
import glob
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import webdataset as wds
from torch.nn.parallel import DistributedDataParallel as DDP

import timm
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", default="/mnt/datasets/in21k-wds")
    ap.add_argument("--val-shards", default="/mnt/datasets/in21k-wds-val")
    ap.add_argument("--num-samples", type=int, default=13_150_000, help="train images per epoch")
    ap.add_argument("--num-classes", type=int, default=21841)
    ap.add_argument("--model", default="vit_base_patch16_224")
    ap.add_argument("--batch-size", type=int, default=256, help="per GPU")
    ap.add_argument("--epochs", type=int, default=90)
    ap.add_argument("--lr", type=float, default=1e-3, help="for global batch 4096")
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--warmup-steps", type=int, default=10_000)
    ap.add_argument("--mixup", type=float, default=0.5)
    ap.add_argument("--drop-path", type=float, default=0.1)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--ckpt-dir", default="/shared/ckpt/vit_b16_in21k")
    ap.add_argument("--resume", action="store_true")
    return ap.parse_args()


def make_train_loader(args, transform):
    urls = sorted(glob.glob(os.path.join(args.shards, "imagenet21k-train-*.tar")))
    dataset = (
        wds.WebDataset(urls, shardshuffle=True, nodesplitter=wds.split_by_node,
                       workersplitter=wds.split_by_worker, handler=wds.warn_and_continue)
        .shuffle(5000)
        .decode("pil", handler=wds.warn_and_continue)
        .to_tuple("jpg;jpeg;png", "cls")
        .map_tuple(transform, int)
        .batched(args.batch_size, partial=False)
    )
    loader = wds.WebLoader(dataset, batch_size=None, shuffle=False, num_workers=args.workers,
                           pin_memory=True, persistent_workers=True)
    return loader


def make_val_loader(args, transform):
    urls = sorted(glob.glob(os.path.join(args.val_shards, "imagenet21k-val-*.tar")))
    dataset = (
        wds.WebDataset(urls, shardshuffle=False, nodesplitter=wds.split_by_node)
        .decode("pil")
        .to_tuple("jpg;jpeg;png", "cls")
        .map_tuple(transform, int)
        .batched(args.batch_size, partial=True)
    )
    return wds.WebLoader(dataset, batch_size=None, num_workers=4)


def cosine_lr(step, total, warmup, base_lr):
    if step < warmup:
        return base_lr * step / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return base_lr * 0.5 * (1.0 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    counts = torch.zeros(2, device=device)
    for images, labels in loader:
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(images)
        counts[0] += (logits.argmax(-1) == labels).sum()
        counts[1] += labels.numel()
    dist.all_reduce(counts)
    return (100.0 * counts[0] / counts[1].clamp(min=1)).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    main_proc = rank == 0

    train_tf = create_transform(224, is_training=True, auto_augment="rand-m15-n2-mstd0.5",
                                interpolation="bicubic")
    val_tf = create_transform(224, is_training=False, interpolation="bicubic", crop_pct=0.875)
    train_loader = make_train_loader(args, train_tf)
    val_loader = make_val_loader(args, val_tf)

    global_batch = args.batch_size * world
    steps_per_epoch = args.num_samples // global_batch
    total_steps = steps_per_epoch * args.epochs
    base_lr = args.lr * global_batch / 4096

    model = timm.create_model(args.model, num_classes=args.num_classes,
                              drop_path_rate=args.drop_path).to(device)
    model = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)
    raw = model.module

    decay, no_decay = [], []
    for n, p in raw.named_parameters():
        (no_decay if p.ndim <= 1 or n in ("cls_token", "pos_embed") else decay).append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=base_lr, betas=(0.9, 0.999), fused=True)
    mixup = Mixup(mixup_alpha=args.mixup, cutmix_alpha=0.0, label_smoothing=0.0,
                  num_classes=args.num_classes)
    criterion = SoftTargetCrossEntropy()

    start_epoch, step = 0, 0
    ckpt_path = os.path.join(args.ckpt_dir, "last.pt")
    if args.resume and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        raw.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optim"])
        start_epoch, step = ckpt["epoch"] + 1, ckpt["step"]
    if main_proc:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        print(f"world={world} global_batch={global_batch} lr={base_lr:.2e} "
              f"steps/epoch~{steps_per_epoch}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros((), device=device)
        n_iter = 0
        for images, labels in train_loader:
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            images, targets = mixup(images, labels)

            lr = cosine_lr(step, total_steps, args.warmup_steps, base_lr)
            for g in optimizer.param_groups:
                g["lr"] = lr

            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(images), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()

            loss_sum += loss.detach()
            n_iter += 1
            step += 1
            if main_proc and step % 500 == 0:
                ips = n_iter * global_batch / (time.time() - t0)
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} lr {lr:.2e} "
                      f"{ips:.0f} img/s", flush=True)

        stats = torch.stack([loss_sum, torch.tensor(float(n_iter), device=device)])
        dist.all_reduce(stats)
        top1 = evaluate(raw, val_loader, device)

        if main_proc:
            torch.save({"model": raw.state_dict(), "optim": optimizer.state_dict(),
                        "epoch": epoch, "step": step}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
            rec = {"epoch": epoch, "train_loss": (stats[0] / stats[1]).item(), "val_top1": top1,
                   "time_s": time.time() - t0}
            with open(os.path.join(args.ckpt_dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(rec) + "\n")
            print(rec, flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
