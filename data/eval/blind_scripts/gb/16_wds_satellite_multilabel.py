"""Multi-label land-cover classification on satellite tiles stored as webdataset shards.

Each sample: "<key>.png" (RGB 120x120 tile upsampled to 128) + "<key>.json" ({"labels": [int, ...]}).
A fixed fraction of the shards is held out for validation.

torchrun --nproc_per_node=8 16_wds_satellite_multilabel.py --shard-dir /data/bigearthnet-wds
"""
import argparse
import glob
import json
import os
import random
import time

import kornia.augmentation as K
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision.transforms.functional as TF
import webdataset as wds
from torch.nn.parallel import DistributedDataParallel as DDP

NUM_LABELS = 19


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--shard-dir", required=True)
    p.add_argument("--val-frac", type=float, default=0.05)
    p.add_argument("--samples-per-shard", type=int, default=2000)
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--threshold", type=float, default=0.5)
    p.add_argument("--out", default="/data/experiments/ben_multilabel")
    return p.parse_args()


def to_sample(sample):
    img = TF.pil_to_tensor(sample["png"].convert("RGB"))
    img = TF.resize(img, [128, 128], antialias=True)
    target = torch.zeros(NUM_LABELS)
    target[json.loads(sample["json"])["labels"]] = 1.0
    return img, target


def build_dataset(shards, batch_size, train):
    ds = wds.WebDataset(shards, nodesplitter=wds.split_by_node, shardshuffle=100 if train else False,
                        handler=wds.warn_and_continue)
    if train:
        ds = ds.shuffle(5000)
    return ds.decode("pil").map(to_sample).batched(batch_size, partial=not train)


def split_shards(shard_dir, val_frac):
    shards = sorted(glob.glob(os.path.join(shard_dir, "ben-*.tar")))
    random.shuffle(shards)
    n_val = max(1, int(round(len(shards) * val_frac)))
    return shards[n_val:], shards[:n_val]


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_shards, val_shards = split_shards(args.shard_dir, args.val_frac)
    n_train = len(train_shards) * args.samples_per_shard
    steps_per_epoch = n_train // (args.batch_size * world)
    train_loader = (wds.WebLoader(build_dataset(train_shards, args.batch_size, train=True), batch_size=None,
                                  num_workers=args.workers, pin_memory=True, persistent_workers=True)
                    .repeat()
                    .with_epoch(steps_per_epoch))
    val_loader = wds.WebLoader(build_dataset(val_shards, 512, train=False), batch_size=None,
                               num_workers=args.workers, pin_memory=True)

    # tiles have no canonical orientation: flips + 90 degree rotations are label-preserving
    gpu_aug = K.AugmentationSequential(
        K.RandomHorizontalFlip(),
        K.RandomVerticalFlip(),
        K.RandomRotation(degrees=90.0, p=0.5),
        K.ColorJitter(0.1, 0.1, 0.1, 0.0, p=0.5),
    ).to(device)
    normalize = K.Normalize(mean=torch.tensor([0.35, 0.38, 0.33]), std=torch.tensor([0.19, 0.17, 0.16])).to(device)

    model = timm.create_model(args.arch, num_classes=NUM_LABELS).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 256
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr,
                                                    total_steps=args.epochs * steps_per_epoch, pct_start=0.1)
    criterion = nn.BCEWithLogitsLoss()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(train_shards)} train shards, {len(val_shards)} val shards, {steps_per_epoch} steps/epoch")

    best_f1 = 0.0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for step, (x, y) in enumerate(train_loader):
            x = x.to(device, non_blocking=True).float().div_(255)
            y = y.to(device, non_blocking=True)
            with torch.no_grad():
                x = normalize(gpu_aug(x))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(x).float(), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if step % 100 == 0 and rank == 0:
                print(f"epoch {epoch} step {step}/{steps_per_epoch} loss {loss.item():.4f}", flush=True)

        model.eval()
        counts = torch.zeros(3, NUM_LABELS, device=device)  # tp, fp, fn per class
        with torch.no_grad():
            for x, y in val_loader:
                x = normalize(x.to(device, non_blocking=True).float().div_(255))
                y = y.to(device, non_blocking=True).bool()
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    pred = torch.sigmoid(model.module(x).float()) > args.threshold
                counts[0] += (pred & y).sum(0)
                counts[1] += (pred & ~y).sum(0)
                counts[2] += (~pred & y).sum(0)
        dist.all_reduce(counts)
        tp, fp, fn = counts.sum(1)
        micro_f1 = (2 * tp / (2 * tp + fp + fn).clamp(min=1)).item()
        macro_f1 = (2 * counts[0] / (2 * counts[0] + counts[1] + counts[2]).clamp(min=1)).mean().item()

        if rank == 0:
            print(f"epoch {epoch} micro-F1 {micro_f1:.4f} macro-F1 {macro_f1:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            state = {"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "val_shards": val_shards}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if micro_f1 > best_f1:
                best_f1 = micro_f1
                torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
