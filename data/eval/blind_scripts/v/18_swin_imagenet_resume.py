#!/usr/bin/env python3
"""Swin-B training on the merged ImageNet-1k + in-house food taxonomy (1,312 classes).

Slurm job (preemptible partition, requeued automatically, so the script must resume):

    #SBATCH --partition=preempt --requeue --signal=USR1@120
    #SBATCH --nodes=2 --ntasks-per-node=1 --gpus-per-node=8 --cpus-per-task=64
    nodes=( $(scontrol show hostnames $SLURM_JOB_NODELIST) )
    srun torchrun --nnodes=2 --nproc_per_node=8 \
         --rdzv_id=$SLURM_JOB_ID --rdzv_backend=c10d --rdzv_endpoint=${nodes[0]}:29500 \
         swin_train.py --train /datasets/food1312/train --val /datasets/food1312/val \
         --output /checkpoints/swin_b_food1312 --epochs 300

Checkpoint: <output>/checkpoint.pth, overwritten every epoch; resumed automatically.
"""
import argparse
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from timm.scheduler import CosineLRScheduler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torch.utils.tensorboard import SummaryWriter
from torchvision.datasets import ImageFolder


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--arch", default="swin_base_patch4_window7_224")
    p.add_argument("--num-classes", type=int, default=1312)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--warmup-epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--blr", type=float, default=5e-4, help="lr for batch 512, scaled linearly")
    p.add_argument("--wd", type=float, default=0.05)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


def save_checkpoint(path, model, optimizer, scaler, epoch, best_acc):
    tmp = path + ".tmp"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(), "epoch": epoch, "best_acc": best_acc}, tmp)
    os.replace(tmp, path)


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    correct = torch.zeros(1, device=device)
    total = torch.zeros(1, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(x)
        correct += (logits.argmax(1) == y).sum()
        total += y.numel()
    dist.all_reduce(correct)
    dist.all_reduce(total)
    return (correct / total).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    train_tf = create_transform(224, is_training=True, color_jitter=0.4, auto_augment="rand-m9-mstd0.5-inc1",
                                re_prob=0.25, re_mode="pixel", interpolation="bicubic")
    val_tf = create_transform(224, is_training=False, interpolation="bicubic", crop_pct=0.875)
    train_set = ImageFolder(args.train, transform=train_tf)
    val_set = ImageFolder(args.val, transform=val_tf)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=200,
                            num_workers=args.workers, pin_memory=True)

    model = timm.create_model(args.arch, pretrained=False, num_classes=args.num_classes, drop_path_rate=0.5)
    model.to(device)

    lr = args.blr * args.batch_size * world / 512
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.wd)
    scaler = torch.cuda.amp.GradScaler()
    start_epoch, best_acc = 0, 0.0
    ckpt_path = os.path.join(args.output, "checkpoint.pth")
    if os.path.isfile(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_acc = ckpt["epoch"] + 1, ckpt["best_acc"]
        if rank == 0:
            print(f"=> resumed from epoch {ckpt['epoch']} (best acc {best_acc:.4f})", flush=True)

    model = DDP(model, device_ids=[local_rank])
    sched = CosineLRScheduler(optimizer, t_initial=args.epochs, lr_min=1e-6, warmup_t=args.warmup_epochs,
                              warmup_lr_init=1e-7, t_in_epochs=True)
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=args.num_classes)
    criterion = SoftTargetCrossEntropy()

    writer = None
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.output, "tb"))

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        sched.step(epoch)
        model.train()
        t0 = time.time()
        for it, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x, y_soft = mixup(x, y)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(model(x), y_soft)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            if writer is not None and it % 100 == 0:
                gstep = epoch * len(train_loader) + it
                writer.add_scalar("train/loss", loss.item(), gstep)
                writer.add_scalar("train/lr", optimizer.param_groups[0]["lr"], gstep)

        acc = validate(model.module, val_loader, device)
        if rank == 0:
            best_acc = max(best_acc, acc)
            writer.add_scalar("val/top1", acc, epoch)
            print(f"epoch {epoch} top1 {acc:.4f} best {best_acc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            save_checkpoint(ckpt_path, model, optimizer, scaler, epoch, best_acc)
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
