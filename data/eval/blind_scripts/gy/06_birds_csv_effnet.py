#!/usr/bin/env python
"""
Backyard bird classifier (my own feeder-cam photos + the labels.csv I keep
updating), EfficientNet-B2 from torchvision, trained on three machines:

  rig0  192.168.50.10  RTX 3090      node_rank 0
  rig1  192.168.50.11  RTX 3070
  rig2  192.168.50.12  RTX 2080 Ti

The image folder + labels.csv are rsynced to every rig before a run
(~/feeder/images, ~/feeder/labels.csv).

  torchrun --nnodes=3 --nproc_per_node=1 --node_rank=$NODE \
      --master_addr=192.168.50.10 --master_port=29511 train_birds.py
"""
import argparse
import os
import time

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from torchvision.models import EfficientNet_B2_Weights, efficientnet_b2


class FeederDataset(Dataset):
    def __init__(self, df, img_dir, class_to_idx, transform):
        self.paths = [os.path.join(img_dir, f) for f in df["filename"]]
        self.targets = [class_to_idx[c] for c in df["species"]]
        self.transform = transform

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = Image.open(self.paths[i]).convert("RGB")
        return self.transform(img), self.targets[i]


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", default=os.path.expanduser("~/feeder/images"))
    ap.add_argument("--labels", default=os.path.expanduser("~/feeder/labels.csv"))
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--bs", type=int, default=24)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--min-count", type=int, default=15, help="drop species with fewer photos")
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--out", default="birds_effb2.pt")
    return ap.parse_args()


def build_data(args, rank, world):
    df = pd.read_csv(args.labels)
    df = df[df["species"].notna() & (df["species"] != "unknown")]
    counts = df["species"].value_counts()
    df = df[df["species"].isin(counts[counts >= args.min_count].index)]

    classes = list(set(df["species"]))
    class_to_idx = {c: i for i, c in enumerate(classes)}

    # the csv has a fixed split column so every rig agrees on train/val
    train_df = df[df["split"] == "train"]
    val_df = df[df["split"] == "val"]

    weights = EfficientNet_B2_Weights.IMAGENET1K_V1
    mean, std = weights.transforms().mean, weights.transforms().std
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(288, scale=(0.5, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.ColorJitter(0.3, 0.3, 0.2, 0.02),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    val_tf = transforms.Compose([
        transforms.Resize(288),
        transforms.CenterCrop(288),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    train_ds = FeederDataset(train_df, args.images, class_to_idx, train_tf)
    val_ds = FeederDataset(val_df, args.images, class_to_idx, val_tf)
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler,
                          num_workers=args.workers, pin_memory=True, drop_last=True)
    # each rig scores every world-th val image; counts are summed afterwards
    val_dl = DataLoader(Subset(val_ds, list(range(rank, len(val_ds), world))), batch_size=args.bs * 2,
                        num_workers=args.workers, pin_memory=True)
    return classes, train_dl, val_dl, train_sampler


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    classes, train_dl, val_dl, train_sampler = build_data(args, rank, world)
    if rank == 0:
        print(f"{len(classes)} species, {len(train_dl.dataset)} train / {len(val_dl.dataset.dataset)} val images")

    model = efficientnet_b2(weights=EfficientNet_B2_Weights.IMAGENET1K_V1)
    model.classifier[1] = nn.Linear(model.classifier[1].in_features, len(classes))
    model = DDP(model.to(device), device_ids=[local_rank])

    # head gets 10x lr, backbone is pretrained
    head_params = list(model.module.classifier.parameters())
    head_ids = {id(p) for p in head_params}
    body_params = [p for p in model.parameters() if id(p) not in head_ids]
    opt = torch.optim.AdamW([
        {"params": body_params, "lr": args.lr},
        {"params": head_params, "lr": args.lr * 10},
    ], weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=[args.lr, args.lr * 10], total_steps=args.epochs * len(train_dl), pct_start=0.15)
    scaler = torch.cuda.amp.GradScaler()
    crit = nn.CrossEntropyLoss(label_smoothing=0.1)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        tl = torch.zeros(2, device=device)
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = crit(model(x), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            tl[0] += loss.detach() * x.size(0)
            tl[1] += x.size(0)

        model.eval()
        vs = torch.zeros(2, device=device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            for x, y in val_dl:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                vs[0] += (model.module(x).argmax(1) == y).sum()
                vs[1] += y.numel()
        dist.all_reduce(tl)
        dist.all_reduce(vs)
        acc = (vs[0] / vs[1]).item()

        if rank == 0:
            print(f"[{epoch + 1}/{args.epochs}] loss {tl[0] / tl[1]:.4f} val_acc {acc:.4f} "
                  f"{time.time() - tic:.0f}s")
            if acc > best:
                best = acc
                torch.save({"state_dict": model.module.state_dict(), "classes": classes,
                            "epoch": epoch, "val_acc": acc}, args.out)
    if rank == 0:
        print(f"best val acc {best:.4f} -> {args.out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
