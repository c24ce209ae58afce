#!/usr/bin/env python3
"""ConvNeXt-T ImageNet training, timm-style, with EMA and auto-resume (jobs get preempted on our cluster).

    torchrun --nproc_per_node=8 train.py /data/imagenet --model convnext_tiny -b 128 --lr 4e-3 \
        --epochs 300 --model-ema --output ./output/convnext_t --resume ./output/convnext_t/last.pth.tar
"""
import argparse
import logging
import math
import os
import time
from copy import deepcopy

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from torchvision import datasets, transforms

_logger = logging.getLogger("train")


class ModelEma(nn.Module):
    def __init__(self, model, decay=0.9999):
        super().__init__()
        self.module = deepcopy(model).eval()
        self.decay = decay
        for p in self.module.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model):
        for ema_v, v in zip(self.module.state_dict().values(), model.state_dict().values()):
            if ema_v.dtype.is_floating_point:
                ema_v.mul_(self.decay).add_(v, alpha=1 - self.decay)
            else:
                ema_v.copy_(v)


def get_args():
    p = argparse.ArgumentParser("ImageNet training")
    p.add_argument("data_dir")
    p.add_argument("--model", default="convnext_tiny")
    p.add_argument("-b", "--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=4e-3, help="learning rate for a global batch of 4096")
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--warmup-epochs", type=int, default=20)
    p.add_argument("--drop-path", type=float, default=0.1)
    p.add_argument("--mixup", type=float, default=0.8)
    p.add_argument("--cutmix", type=float, default=1.0)
    p.add_argument("--smoothing", type=float, default=0.1)
    p.add_argument("--clip-grad", type=float, default=None)
    p.add_argument("--model-ema", action="store_true")
    p.add_argument("--model-ema-decay", type=float, default=0.9999)
    p.add_argument("-j", "--workers", type=int, default=8)
    p.add_argument("--output", default="./output")
    p.add_argument("--resume", default="")
    return p.parse_args()


def cosine_lr(step, total, warmup, base_lr, min_lr=1e-6):
    if step < warmup:
        return base_lr * step / warmup
    return min_lr + 0.5 * (base_lr - min_lr) * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    correct1 = correct5 = total = 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
        top5 = out.topk(5, dim=1).indices
        correct1 += (top5[:, 0] == y).sum()
        correct5 += (top5 == y[:, None]).any(dim=1).sum()
        total += y.numel()
    t = torch.stack([correct1.float(), correct5.float(), torch.tensor(float(total), device=device)])
    dist.all_reduce(t)
    return (100 * t[0] / t[2]).item(), (100 * t[1] / t[2]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING)
    torch.backends.cudnn.benchmark = True

    model = timm.create_model(args.model, pretrained=False, drop_path_rate=args.drop_path, num_classes=1000)
    model.to(device)
    model_ema = ModelEma(model, args.model_ema_decay) if args.model_ema else None
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])

    global_batch = args.batch_size * world_size
    base_lr = args.lr * global_batch / 4096
    decay, no_decay = [], []
    for n, p in model.module.named_parameters():
        (no_decay if p.ndim <= 1 or n.endswith(".bias") else decay).append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=base_lr)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch, best_acc = 0, 0.0
    if args.resume and os.path.isfile(args.resume):
        checkpoint = torch.load(args.resume)
        model.module.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scaler.load_state_dict(checkpoint["scaler"])
        if model_ema is not None and "state_dict_ema" in checkpoint:
            model_ema.module.load_state_dict(checkpoint["state_dict_ema"])
        start_epoch = checkpoint["epoch"] + 1
        best_acc = checkpoint.get("best_acc", 0.0)
        _logger.info(f"Resumed from {args.resume} at epoch {start_epoch}")

    train_tf = create_transform(224, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                                re_prob=0.25, interpolation="bicubic")
    val_tf = transforms.Compose([transforms.Resize(256, interpolation=transforms.InterpolationMode.BICUBIC),
                                 transforms.CenterCrop(224), transforms.ToTensor(),
                                 transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    train_set = datasets.ImageFolder(os.path.join(args.data_dir, "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data_dir, "val"), val_tf)
    train_sampler = torch.utils.data.DistributedSampler(train_set)
    train_loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                                               num_workers=args.workers, pin_memory=True, drop_last=True,
                                               persistent_workers=True)
    # 50000 val images split evenly over 8 GPUs
    val_loader = torch.utils.data.DataLoader(val_set, batch_size=200,
                                             sampler=torch.utils.data.DistributedSampler(val_set, shuffle=False),
                                             num_workers=args.workers, pin_memory=True)
    mixup_fn = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=args.smoothing,
                     num_classes=1000)
    criterion = SoftTargetCrossEntropy()

    steps_per_epoch = len(train_loader)
    total_steps = args.epochs * steps_per_epoch
    warmup_steps = args.warmup_epochs * steps_per_epoch
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_acc = torch.zeros(2, device=device)
        for i, (x, y) in enumerate(train_loader):
            step = epoch * steps_per_epoch + i
            lr = cosine_lr(step, total_steps, warmup_steps, base_lr)
            for g in optimizer.param_groups:
                g["lr"] = lr
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x, y = mixup_fn(x, y)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            if args.clip_grad is not None:
                scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            scaler.step(optimizer)
            scaler.update()
            if model_ema is not None:
                model_ema.update(model.module)
            loss_acc += torch.stack([loss.detach().float(), torch.ones((), device=device)])

        dist.all_reduce(loss_acc)
        top1, top5 = validate(model, val_loader, device)
        ema_top1 = validate(model_ema.module, val_loader, device)[0] if model_ema is not None else float("nan")
        _logger.info(f"epoch {epoch}: train_loss {(loss_acc[0] / loss_acc[1]).item():.4f} top1 {top1:.2f} "
                     f"top5 {top5:.2f} ema_top1 {ema_top1:.2f} ({time.time() - t0:.0f}s)")
        if rank == 0:
            is_best = top1 > best_acc
            best_acc = max(best_acc, top1)
            state = {"epoch": epoch, "arch": args.model, "state_dict": model.module.state_dict(),
                     "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(), "best_acc": best_acc}
            if model_ema is not None:
                state["state_dict_ema"] = model_ema.module.state_dict()
            torch.save(state, os.path.join(args.output, "last.pth.tar"))
            if is_best:
                torch.save(state, os.path.join(args.output, "model_best.pth.tar"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
