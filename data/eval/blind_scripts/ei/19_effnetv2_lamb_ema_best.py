#!/usr/bin/env python3
"""EfficientNetV2-S / LAMB with progressive image size and EMA, keeps the best EMA.

    torchrun --nproc_per_node=8 19_effnetv2_lamb_ema_best.py --data /datasets/imagenet
"""
import argparse
import math
import os
import shutil
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy
from timm.optim import Lamb
from timm.utils import ModelEmaV2

STAGES = [(128, 0.1), (160, 0.2), (192, 0.3), (224, 0.4)]  # (train size, randaug/dropout scale)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/datasets/imagenet")
    p.add_argument("--epochs", type=int, default=350)
    p.add_argument("--batch-size", type=int, default=256, help="per GPU")
    p.add_argument("--lr", type=float, default=4e-3, help="for a 4096 global batch")
    p.add_argument("--wd", type=float, default=0.02)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--ema-decay", type=float, default=0.9999)
    p.add_argument("--workers", type=int, default=12)
    p.add_argument("--out", default="/checkpoints/effnetv2_s_lamb")
    return p.parse_args()


def stage_for(epoch, epochs):
    return STAGES[min(len(STAGES) - 1, epoch * len(STAGES) // epochs)]


def train_loader_for(args, size, magnitude):
    tf = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(),
                    T.RandAugment(num_ops=2, magnitude=int(5 + 10 * magnitude)),
                    T.ToTensor(), T.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))])
    ds = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), tf)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, args.batch_size, sampler=sampler, num_workers=args.workers,
                    pin_memory=True, drop_last=True)
    return dl, sampler


def val_loader(args):
    tf = T.Compose([T.Resize(384), T.CenterCrop(384), T.ToTensor(),
                    T.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))])
    ds = torchvision.datasets.ImageFolder(os.path.join(args.data, "val"), tf)
    return DataLoader(ds, 128, sampler=DistributedSampler(ds, shuffle=False),
                      num_workers=args.workers, pin_memory=True)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct, count = 0, 0
    for x, y in loader:
        x = x.to(device, non_blocking=True).to(memory_format=torch.channels_last)
        y = y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
        correct += (out.argmax(1) == y).sum().item()
        count += y.size(0)
    return 100.0 * correct / count


def main():
    args = get_args()
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    model = torchvision.models.efficientnet_v2_s(dropout=0.2, stochastic_depth_prob=0.2)
    model = model.to(device, memory_format=torch.channels_last)
    model = DDP(model, device_ids=[local_rank])
    ema = ModelEmaV2(model.module, decay=args.ema_decay)

    global_batch = args.batch_size * world
    peak = args.lr * global_batch / 4096
    optimizer = Lamb([{"params": [p for p in model.parameters() if p.ndim > 1],
                       "weight_decay": args.wd},
                      {"params": [p for p in model.parameters() if p.ndim <= 1],
                       "weight_decay": 0.0}], lr=peak)
    mixup = Mixup(mixup_alpha=0.2, cutmix_alpha=0.0, label_smoothing=0.1, num_classes=1000)
    criterion = SoftTargetCrossEntropy()
    v_loader = val_loader(args)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"global batch {global_batch}, peak lr {peak:.2e}", flush=True)

    current_stage = None
    t_loader, t_sampler = None, None
    best = 0.0
    step = 0
    for epoch in range(args.epochs):
        stage = stage_for(epoch, args.epochs)
        if stage != current_stage:
            current_stage = stage
            t_loader, t_sampler = train_loader_for(args, *stage)
            if rank == 0:
                print(f"epoch {epoch}: train size {stage[0]}", flush=True)
        steps_per_epoch = len(t_loader)
        total = steps_per_epoch * args.epochs
        warm = steps_per_epoch * args.warmup_epochs

        t_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, y) in enumerate(t_loader):
            lr = peak * (step + 1) / warm if step < warm else \
                peak * 0.5 * (1 + math.cos(math.pi * (step - warm) / (total - warm)))
            for g in optimizer.param_groups:
                g["lr"] = lr
            x = x.to(device, non_blocking=True).to(memory_format=torch.channels_last)
            y = y.to(device, non_blocking=True)
            x, y = mixup(x, y)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            ema.update(model.module)
            step += 1
            if rank == 0 and i % 200 == 0:
                print(f"ep {epoch} it {i}/{steps_per_epoch} loss {loss.item():.4f} lr {lr:.2e} "
                      f"{(i + 1) * global_batch / (time.time() - t0):.0f} img/s", flush=True)

        top1 = evaluate(model, v_loader, device)
        top1_ema = evaluate(ema.module, v_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: top1 {top1:.2f} ema {top1_ema:.2f} ({time.time() - t0:.0f}s)",
                  flush=True)
            last = os.path.join(args.out, "last.pth")
            torch.save({"epoch": epoch, "model": model.module.state_dict(),
                        "ema": ema.module.state_dict(), "optimizer": optimizer.state_dict()},
                       last)
            if top1_ema > best:
                best = top1_ema
                shutil.copyfile(last, os.path.join(args.out, "best_ema.pth"))
                print(f"new best ema top1 {best:.2f}", flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
