#!/usr/bin/env python3
"""RegNetY-16GF: transfer an ImageNet-21k (SWAG-style) checkpoint to ImageNet-1k.

Options for repeated augmentation, mixup/cutmix and EMA; SyncBN because the per-GPU
batch is small at 384px.
"""
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, RandomSampler, Subset
from torchvision import datasets

import timm
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from timm.scheduler import CosineLRScheduler
from timm.utils import ModelEmaV2, accuracy


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/datasets/imagenet")
    p.add_argument("--model", default="regnety_160")
    p.add_argument("--weights", default="/models/regnety_16gf_in21k.pth")
    p.add_argument("--img-size", type=int, default=384)
    p.add_argument("--batch-size", type=int, default=24)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=0.05, help="SGD lr for a global batch of 512")
    p.add_argument("--wd", type=float, default=5e-5)
    p.add_argument("--warmup-epochs", type=int, default=2)
    p.add_argument("--repeated-aug", action="store_true")
    p.add_argument("--num-repeats", type=int, default=3)
    p.add_argument("--mixup", type=float, default=0.2)
    p.add_argument("--cutmix", type=float, default=1.0)
    p.add_argument("--ema-decay", type=float, default=0.9998)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--out", default="./runs/regnety16_ft384")
    return p.parse_args()


class RASampler(torch.utils.data.Sampler):
    """Repeated-augmentation sampler: each image `num_repeats` times per epoch, split over ranks."""

    def __init__(self, dataset, num_replicas, rank, num_repeats=3):
        self.dataset = dataset
        self.num_replicas, self.rank = num_replicas, rank
        self.num_repeats = num_repeats
        self.epoch = 0
        self.num_samples = int(math.ceil(len(dataset) * num_repeats / num_replicas))
        self.total_size = self.num_samples * num_replicas
        self.num_selected_samples = int(math.floor(len(dataset) // 256 * 256 / num_replicas))

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.epoch)
        indices = torch.randperm(len(self.dataset), generator=g)
        indices = torch.repeat_interleave(indices, repeats=self.num_repeats, dim=0).tolist()
        indices += indices[: self.total_size - len(indices)]
        indices = indices[self.rank:self.total_size:self.num_replicas]
        return iter(indices[: self.num_selected_samples])

    def __len__(self):
        return self.num_selected_samples

    def set_epoch(self, epoch):
        self.epoch = epoch


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(3, dtype=torch.float64, device=device)
    for images, target in loader:
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():
            output = model(images)
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        n = target.size(0)
        s[0] += acc1.double() * n / 100
        s[1] += acc5.double() * n / 100
        s[2] += n
    dist.all_reduce(s)
    return (100 * s[0] / s[2]).item(), (100 * s[1] / s[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(100 + rank)

    train_tf = create_transform(args.img_size, is_training=True, auto_augment="rand-m9-mstd0.5",
                                interpolation="bicubic")
    val_tf = create_transform(args.img_size, is_training=False, crop_pct=1.0, interpolation="bicubic")
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)

    if args.repeated_aug:
        train_sampler = RASampler(train_set, num_replicas=world, rank=rank, num_repeats=args.num_repeats)
    else:
        train_sampler = RandomSampler(train_set)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=64,
                            num_workers=args.workers, pin_memory=True)

    model = timm.create_model(args.model, num_classes=1000)
    sd = torch.load(args.weights, map_location="cpu")
    sd = {k: v for k, v in sd.items() if not k.startswith("head.fc.")}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if rank == 0:
        print(f"missing {missing}\nunexpected {unexpected}", flush=True)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.to(device)
    model = DDP(model, device_ids=[local_rank])
    net = model.module
    ema = ModelEmaV2(net, decay=args.ema_decay)

    lr = args.lr * args.batch_size * world / 512
    bn_params = [p for n, p in net.named_parameters() if p.ndim <= 1]
    w_params = [p for n, p in net.named_parameters() if p.ndim > 1]
    optimizer = torch.optim.SGD([{"params": w_params, "weight_decay": args.wd},
                                 {"params": bn_params, "weight_decay": 0.0}],
                                lr=lr, momentum=0.9, nesterov=True)
    iters = len(train_loader)
    scheduler = CosineLRScheduler(optimizer, t_initial=args.epochs * iters, lr_min=0.0,
                                  warmup_t=args.warmup_epochs * iters, warmup_lr_init=lr * 0.01,
                                  t_in_epochs=False)
    mixup = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=0.1, num_classes=1000)
    criterion = SoftTargetCrossEntropy()
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        if hasattr(train_sampler, "set_epoch"):
            train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x, y = mixup(x, y)
            with torch.cuda.amp.autocast():
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step_update(epoch * iters + i + 1)
            ema.update(net)
            if rank == 0 and i % 100 == 0:
                print(f"ep {epoch} [{i}/{iters}] loss {loss.item():.4f} lr {optimizer.param_groups[0]['lr']:.4f}",
                      flush=True)

        acc1, acc5 = evaluate(net, val_loader, device)
        ema1, ema5 = evaluate(ema.module, val_loader, device)
        if rank == 0:
            best = max(best, acc1, ema1)
            rec = {"epoch": epoch, "acc1": acc1, "acc5": acc5, "ema_acc1": ema1, "ema_acc5": ema5,
                   "best": best, "sec": time.time() - t0}
            print(json.dumps(rec), flush=True)
            with open(os.path.join(args.out, "log.jsonl"), "a") as f:
                f.write(json.dumps(rec) + "\n")
            torch.save({"model": net.state_dict(), "ema": ema.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "checkpoint.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
