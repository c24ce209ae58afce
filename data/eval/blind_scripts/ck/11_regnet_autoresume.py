#!/usr/bin/env python3
"""RegNetY-8GF on ImageNet with SGD + label smoothing + EMA, preemption-friendly.

Runs under a Slurm array that requeues on preemption; on restart the job picks up
the newest checkpoint in --output automatically.

    torchrun --nnodes=$SLURM_NNODES --nproc_per_node=8 --rdzv_backend=c10d \
        --rdzv_endpoint=$MASTER_ADDR:29400 11_regnet_autoresume.py --output /lustre/runs/regnety8
"""
import argparse
import glob
import logging
import os
import re
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets

import timm
from timm.data import create_transform
from timm.loss import LabelSmoothingCrossEntropy
from timm.scheduler import CosineLRScheduler
from timm.utils import ModelEmaV2, accuracy

log = logging.getLogger(__name__)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/lustre/datasets/imagenet")
    ap.add_argument("--output", required=True)
    ap.add_argument("--model", default="regnety_080")
    ap.add_argument("--batch-size", type=int, default=128, help="per GPU")
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--warmup-epochs", type=int, default=5)
    ap.add_argument("--lr", type=float, default=0.1, help="per 128 images")
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--wd", type=float, default=5e-5)
    ap.add_argument("--smoothing", type=float, default=0.1)
    ap.add_argument("--ema-decay", type=float, default=0.9998)
    ap.add_argument("--sync-bn", action="store_true")
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--keep", type=int, default=3, help="how many epoch checkpoints to keep")
    return ap.parse_args()


def latest_checkpoint(output):
    ckpts = glob.glob(os.path.join(output, "epoch_*.pth"))
    if not ckpts:
        return None
    return max(ckpts, key=lambda p: int(re.findall(r"epoch_(\d+)\.pth", p)[0]))


def save_checkpoint(state, output, epoch, keep):
    path = os.path.join(output, f"epoch_{epoch:03d}.pth")
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)
    old = sorted(glob.glob(os.path.join(output, "epoch_*.pth")))[:-keep]
    for p in old:
        os.remove(p)


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(x)
        a1, a5 = accuracy(out, y, topk=(1, 5))
        stats += torch.stack([a1 * y.numel() / 100.0, a5 * y.numel() / 100.0,
                              torch.tensor(float(y.numel()), device=device)])
    dist.all_reduce(stats)
    return (100 * stats[0] / stats[2]).item(), (100 * stats[1] / stats[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[%(asctime)s r{rank}] %(message)s")
    torch.manual_seed(0)  # same initial weights on every rank (the EMA copy is made before DDP)

    train_tf = create_transform(224, is_training=True, auto_augment=None, color_jitter=0.4,
                                interpolation="bilinear")
    val_tf = create_transform(224, is_training=False, crop_pct=0.875)
    train_ds = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_ds = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val_ds, list(range(rank, len(val_ds), world))), batch_size=200,
                        num_workers=args.workers, pin_memory=True)

    model = timm.create_model(args.model, num_classes=1000)
    if args.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device, memory_format=torch.channels_last)
    ema = ModelEmaV2(model, decay=args.ema_decay)
    torch.manual_seed(1000 + rank)

    lr = args.lr * args.batch_size * world / 128
    bn_bias = [p for n, p in model.named_parameters() if p.ndim <= 1]
    weights = [p for n, p in model.named_parameters() if p.ndim > 1]
    optimizer = torch.optim.SGD([{"params": weights, "weight_decay": args.wd},
                                 {"params": bn_bias, "weight_decay": 0.0}],
                                lr=lr, momentum=args.momentum, nesterov=True)
    scheduler = CosineLRScheduler(optimizer, t_initial=args.epochs, lr_min=1e-5, warmup_t=args.warmup_epochs,
                                  warmup_lr_init=lr * 0.1)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch, best = 0, 0.0
    ckpt_path = latest_checkpoint(args.output)
    if ckpt_path is not None:
        checkpoint = torch.load(ckpt_path)
        model.load_state_dict(checkpoint["model"])
        ema.module.load_state_dict(checkpoint["ema"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scaler.load_state_dict(checkpoint["scaler"])
        start_epoch, best = checkpoint["epoch"] + 1, checkpoint["best"]
        log.info(f"resumed from {ckpt_path} at epoch {start_epoch}")
    ddp = DDP(model, device_ids=[local_rank])
    criterion = LabelSmoothingCrossEntropy(smoothing=args.smoothing)
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        scheduler.step(epoch)
        ddp.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_dl):
            x = x.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
            y = y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(ddp(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            ema.update(model)
            if i % 200 == 0:
                log.info(f"epoch {epoch} [{i}/{len(train_dl)}] loss {loss.item():.4f} "
                         f"lr {optimizer.param_groups[0]['lr']:.4f}")
        top1, top5 = validate(model, val_dl, device)
        ema_top1, _ = validate(ema.module, val_dl, device)
        best = max(best, ema_top1)
        log.info(f"epoch {epoch} done in {time.time() - t0:.0f}s: top1 {top1:.2f} top5 {top5:.2f} "
                 f"ema {ema_top1:.2f} best {best:.2f}")
        if rank == 0:
            save_checkpoint({"model": model.state_dict(), "ema": ema.module.state_dict(),
                             "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
                             "epoch": epoch, "best": best, "args": vars(args)},
                            args.output, epoch, args.keep)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
