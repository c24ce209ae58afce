#!/usr/bin/env python3
"""EfficientNetV2-S on ImageNet-1k with progressive resizing, mixup and EMA.

Progressive learning (Tan & Le 2021): image size and RandAugment magnitude grow over
four stages. Tracks runs in Weights & Biases.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets

import timm
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from timm.optim import RMSpropTF
from timm.scheduler import StepLRScheduler
from timm.utils import ModelEmaV2

STAGES = [  # (image size, randaug magnitude, mixup alpha, dropout)
    (128, 5, 0.05, 0.1),
    (171, 8, 0.1, 0.133),
    (214, 12, 0.15, 0.167),
    (256, 15, 0.2, 0.2),
]


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/datasets/imagenet")
    ap.add_argument("--model", default="efficientnetv2_rw_s")
    ap.add_argument("--epochs", type=int, default=350)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.016, help="for global batch 1024")
    ap.add_argument("--decay-epochs", type=float, default=2.4)
    ap.add_argument("--decay-rate", type=float, default=0.97)
    ap.add_argument("--warmup-epochs", type=int, default=5)
    ap.add_argument("--wd", type=float, default=1e-5)
    ap.add_argument("--ema", type=float, default=0.9999)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--out", default="./runs/effv2_s")
    ap.add_argument("--wandb-project", default="imagenet-effnetv2")
    ap.add_argument("--run-name", default=None)
    return ap.parse_args()


def stage_for(epoch, epochs):
    return min(epoch * len(STAGES) // epochs, len(STAGES) - 1)


def make_train_loader(args, stage, rank, world):
    size, mag, _, _ = STAGES[stage]
    tf = create_transform(size, is_training=True, auto_augment=f"rand-m{mag}-mstd0.5",
                          interpolation="bicubic")
    ds = datasets.ImageFolder(os.path.join(args.data, "train"), tf)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=False)
    return loader, sampler


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    tally = torch.zeros(2, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(x)
        tally[0] += (out.argmax(1) == y).sum()
        tally[1] += y.numel()
    dist.all_reduce(tally)
    return (100 * tally[0] / tally[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args))

    val_tf = create_transform(288, is_training=False, crop_pct=1.0, interpolation="bicubic")
    val_ds = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=128,
                            num_workers=args.workers, pin_memory=True)

    model = timm.create_model(args.model, num_classes=1000, drop_rate=STAGES[0][3], drop_path_rate=0.2)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.to(device)
    model = DDP(model, device_ids=[local_rank])
    raw = model.module
    ema = ModelEmaV2(raw, decay=args.ema)

    lr = args.lr * args.batch_size * world / 1024
    optimizer = RMSpropTF(raw.parameters(), lr=lr, alpha=0.9, eps=1e-3, momentum=0.9, weight_decay=args.wd)
    # timm's StepLR is driven per epoch
    scheduler = StepLRScheduler(optimizer, decay_t=args.decay_epochs, decay_rate=args.decay_rate,
                                warmup_t=args.warmup_epochs, warmup_lr_init=1e-6)
    criterion = SoftTargetCrossEntropy()
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    cur_stage, train_loader, sampler = -1, None, None
    best = 0.0
    for epoch in range(args.epochs):
        stage = stage_for(epoch, args.epochs)
        if stage != cur_stage:
            cur_stage = stage
            train_loader, sampler = make_train_loader(args, stage, rank, world)
            _, _, mix_alpha, drop = STAGES[stage]
            raw.drop_rate = drop
            mixup = Mixup(mixup_alpha=mix_alpha, cutmix_alpha=0.0, label_smoothing=0.1, num_classes=1000)
            if rank == 0:
                print(f"stage {stage}: size {STAGES[stage][0]} dropout {drop}", flush=True)
        sampler.set_epoch(epoch)
        scheduler.step(epoch)

        model.train()
        t0 = time.time()
        loss_acc = torch.zeros(2, device=device)
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x, y = mixup(x, y)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            ema.update(raw)
            loss_acc += torch.stack([loss.detach().float(), torch.ones((), device=device)])

        dist.all_reduce(loss_acc)
        top1 = evaluate(raw, val_loader, device)
        ema_top1 = evaluate(ema.module, val_loader, device)
        best = max(best, top1, ema_top1)
        wandb.log({"epoch": epoch, "train/loss": (loss_acc[0] / loss_acc[1]).item(),
                   "val/top1": top1, "val/ema_top1": ema_top1, "val/best": best,
                   "lr": optimizer.param_groups[0]["lr"], "epoch_time": time.time() - t0})
        if rank == 0:
            print(f"epoch {epoch} top1 {top1:.2f} ema {ema_top1:.2f}", flush=True)
            torch.save({"model": raw.state_dict(), "ema": ema.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "last.pth"))

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
