"""ViT-S/16 on ImageNet-1k with LAMB and large batches.

Gradient accumulation for when the batch does not fit. Learning rate follows
the linear scaling rule against a reference batch of 512.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        07_lamb_vit_large_batch.py --data /mnt/shared/imagenet --batch-size 256 --accum-steps 1
"""
import argparse
import contextlib
import math
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from timm.optim import Lamb
from timm.utils import ModelEmaV2
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--model", default="vit_small_patch16_224")
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=256, help="images per GPU per micro-step")
    p.add_argument("--accum-steps", type=int, default=1)
    p.add_argument("--base-lr", type=float, default=5e-4, help="lr per 512 images (linear scaling)")
    p.add_argument("--min-lr", type=float, default=1e-6)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--mixup", type=float, default=0.8)
    p.add_argument("--cutmix", type=float, default=1.0)
    p.add_argument("--smoothing", type=float, default=0.1)
    p.add_argument("--drop-path", type=float, default=0.1)
    p.add_argument("--ema-decay", type=float, default=0.99996)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--output", default="/mnt/shared/exp/vit_s_lamb")
    return p


def cosine_lr(step, total, warmup, peak, floor):
    if step < warmup:
        return peak * step / max(1, warmup)
    t = (step - warmup) / max(1, total - warmup)
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * t))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device)
    for images, target in loader:
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(images)
        acc[0] += (logits.argmax(-1) == target).sum()
        acc[1] += target.numel()
    dist.all_reduce(acc)
    return (100.0 * acc[0] / acc[1]).item()


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.backends.cuda.matmul.allow_tf32 = True

    train_tf = create_transform(224, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                                re_prob=0.25, interpolation="bicubic")
    val_tf = create_transform(224, is_training=False, interpolation="bicubic")
    train_set = ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = ImageFolder(os.path.join(args.data, "val"), val_tf)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)),
                            batch_size=256, num_workers=args.workers, pin_memory=True)

    model = timm.create_model(args.model, num_classes=1000, drop_path_rate=args.drop_path).to(device)
    model = DDP(model, device_ids=[local_rank])
    ema = ModelEmaV2(model.module, decay=args.ema_decay)  # after DDP broadcast the rank-0 init

    batch_per_step = args.batch_size * args.accum_steps
    peak_lr = args.base_lr * batch_per_step / 512
    no_wd = [p for n, p in model.named_parameters() if p.ndim <= 1 or n.endswith(".bias") or "pos_embed" in n or "cls_token" in n]
    wd = [p for n, p in model.named_parameters() if not (p.ndim <= 1 or n.endswith(".bias") or "pos_embed" in n or "cls_token" in n)]
    optimizer = Lamb([{"params": wd, "weight_decay": args.weight_decay},
                      {"params": no_wd, "weight_decay": 0.0}], lr=peak_lr)

    mixup_fn = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix,
                     label_smoothing=args.smoothing, num_classes=1000)
    criterion = SoftTargetCrossEntropy()

    steps_per_epoch = len(train_loader) // args.accum_steps
    total_steps = args.epochs * steps_per_epoch
    warmup_steps = args.warmup_epochs * steps_per_epoch

    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        print(f"{world} GPUs, batch {batch_per_step}, peak lr {peak_lr:.2e}, "
              f"{steps_per_epoch} steps/epoch")

    step, best = 0, 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        optimizer.zero_grad(set_to_none=True)
        for i, (images, target) in enumerate(train_loader):
            images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
            images, target = mixup_fn(images, target)
            last_micro = (i + 1) % args.accum_steps == 0
            ctx = contextlib.nullcontext() if last_micro else model.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = criterion(model(images), target) / args.accum_steps
                loss.backward()
            if not last_micro:
                continue

            lr = cosine_lr(step, total_steps, warmup_steps, peak_lr, args.min_lr)
            for g in optimizer.param_groups:
                g["lr"] = lr
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            ema.update(model.module)
            step += 1
            if rank == 0 and step % 100 == 0:
                print(f"ep {epoch} step {step} loss {loss.item() * args.accum_steps:.4f} lr {lr:.2e}")

        top1 = evaluate(model.module, val_loader, device)
        top1_ema = evaluate(ema.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} top1 {top1:.2f} ema {top1_ema:.2f} ({time.time() - tic:.0f}s)")
            ckpt = {"model": model.module.state_dict(), "ema": ema.module.state_dict(),
                    "optimizer": optimizer.state_dict(), "epoch": epoch, "step": step}
            torch.save(ckpt, os.path.join(args.output, "last.pth"))
            if top1_ema > best:
                best = top1_ema
                torch.save(ckpt, os.path.join(args.output, "best.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
