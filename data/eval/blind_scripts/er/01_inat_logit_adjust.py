#!/usr/bin/env python
"""ResNet-50 on iNaturalist 2018 with logit-adjusted cross-entropy.

Logit adjustment (Menon et al., ICLR 2021): during training the logits are
shifted by tau * log(pi_y), where pi is the empirical class prior of the
training set. At test time plain argmax over the unadjusted logits is used.

    torchrun --nproc_per_node=8 inat_logit_adjust.py --data-root /datasets/inat2018
"""
import argparse
import json
import logging
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

logger = logging.getLogger("inat_la")


def parse_args():
    p = argparse.ArgumentParser(description="iNat2018 logit adjustment")
    p.add_argument("--data-root", default="/datasets/inat2018")
    p.add_argument("--train-json", default="train2018.json")
    p.add_argument("--val-json", default="val2018.json")
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--batch-size", type=int, default=64, help="images per GPU")
    p.add_argument("--base-lr", type=float, default=0.1, help="lr for a global batch of 256")
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--tau", type=float, default=1.0)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--out", default="./runs/inat_la")
    p.add_argument("--resume", default="")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class INatDataset(Dataset):
    def __init__(self, root, ann_file, transform):
        with open(os.path.join(root, ann_file)) as f:
            ann = json.load(f)
        label_of = {a["image_id"]: a["category_id"] for a in ann["annotations"]}
        self.samples = [(os.path.join(root, im["file_name"]), label_of[im["id"]])
                        for im in ann["images"]]
        self.num_classes = len(ann["categories"])
        self.transform = transform

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        path, target = self.samples[idx]
        img = Image.open(path).convert("RGB")
        return self.transform(img), target

    def class_counts(self):
        counts = np.zeros(self.num_classes, dtype=np.int64)
        for _, y in self.samples:
            counts[y] += 1
        return counts


def build_transforms():
    normalize = transforms.Normalize([0.466, 0.471, 0.380], [0.195, 0.194, 0.192])
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224),
        transforms.RandomHorizontalFlip(),
        transforms.ColorJitter(0.4, 0.4, 0.4),
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


class LogitAdjustedCE(nn.Module):
    def __init__(self, class_counts, tau=1.0):
        super().__init__()
        prior = torch.as_tensor(class_counts, dtype=torch.float32)
        prior = prior / prior.sum()
        self.register_buffer("log_prior", tau * torch.log(prior + 1e-12))

    def forward(self, logits, target):
        return F.cross_entropy(logits + self.log_prior, target)


def shot_masks(train_counts):
    many = train_counts > 100
    few = train_counts < 20
    medium = ~(many | few)
    return many, medium, few


@torch.no_grad()
def evaluate(model, loader, train_counts, device):
    model.eval()
    num_classes = len(train_counts)
    correct = torch.zeros(num_classes, device=device)
    total = torch.zeros(num_classes, device=device)
    for images, targets in loader:
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(images)
        pred = logits.argmax(dim=1)
        total += torch.bincount(targets, minlength=num_classes).float()
        correct += torch.bincount(targets[pred == targets], minlength=num_classes).float()

    per_class = (correct / total.clamp(min=1)).cpu().numpy()
    seen = total.cpu().numpy() > 0
    many, medium, few = shot_masks(train_counts)
    return {
        "top1": (correct.sum() / total.sum()).item() * 100,
        "many": per_class[many & seen].mean() * 100,
        "medium": per_class[medium & seen].mean() * 100,
        "few": per_class[few & seen].mean() * 100,
    }


def adjust_lr(optimizer, epoch, it, iters_per_epoch, args, peak_lr):
    t = epoch + it / iters_per_epoch
    if t < args.warmup_epochs:
        lr = peak_lr * t / args.warmup_epochs
    else:
        lr = 0.5 * peak_lr * (1 + math.cos(math.pi * (t - args.warmup_epochs) / (args.epochs - args.warmup_epochs)))
    for g in optimizer.param_groups:
        g["lr"] = lr
    return lr


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    torch.backends.cudnn.benchmark = True

    train_tf, val_tf = build_transforms()
    train_set = INatDataset(args.data_root, args.train_json, train_tf)
    val_set = INatDataset(args.data_root, args.val_json, val_tf)
    train_counts = train_set.class_counts()
    logger.info("train %d imgs, val %d imgs, %d classes, max/min count %d/%d",
                len(train_set), len(val_set), train_set.num_classes,
                train_counts.max(), train_counts.min())

    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=128, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    model = torchvision.models.__dict__[args.arch](num_classes=train_set.num_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    criterion = LogitAdjustedCE(train_counts, tau=args.tau).to(device)
    peak_lr = args.base_lr * args.batch_size * world_size / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=peak_lr, momentum=0.9,
                                weight_decay=args.wd, nesterov=True)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch, best_top1 = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_top1 = ckpt["epoch"] + 1, ckpt["best_top1"]
        logger.info("resumed from %s (epoch %d)", args.resume, ckpt["epoch"])

    os.makedirs(args.out, exist_ok=True)
    iters = len(train_loader)
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (images, targets) in enumerate(train_loader):
            lr = adjust_lr(optimizer, epoch, it, iters, args, peak_lr)
            images = images.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(images)
            loss = criterion(logits.float(), targets)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if it % 100 == 0:
                logger.info("ep %d it %d/%d loss %.4f lr %.4f", epoch, it, iters, loss.item(), lr)

        stats = evaluate(model, val_loader, train_counts, device)
        if rank == 0:
            logger.info("epoch %d (%.0fs) top1 %.2f | many %.2f medium %.2f few %.2f",
                        epoch, time.time() - t0, stats["top1"], stats["many"],
                        stats["medium"], stats["few"])
            is_best = stats["top1"] > best_top1
            best_top1 = max(best_top1, stats["top1"])
            ckpt = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "scaler": scaler.state_dict(), "epoch": epoch, "best_top1": best_top1,
                    "args": vars(args)}
            torch.save(ckpt, os.path.join(args.out, "last.pth"))
            if is_best:
                torch.save(ckpt, os.path.join(args.out, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
