#!/usr/bin/env python
# ConvNeXt-B ImageNet-1k fine-tuning from an ImageNet-22k checkpoint.
# Layer-wise lr decay, gradient accumulation, activation checkpointing,
# bf16 autocast, channels_last, EMA.
import argparse
import math
import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets, transforms

import timm
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from timm.scheduler import CosineLRScheduler
from timm.utils import ModelEmaV2


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/imagenet")
    ap.add_argument("--out", default="/checkpoints/convnext_b_ft")
    ap.add_argument("--model", default="convnext_base")
    ap.add_argument("--pretrained", default="/checkpoints/convnext_base_22k_224.pth")
    ap.add_argument("--img-size", type=int, default=224)
    ap.add_argument("--batch-size", type=int, default=32, help="per GPU, per micro step")
    ap.add_argument("--accum-iter", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--warmup-epochs", type=int, default=5)
    ap.add_argument("--blr", type=float, default=5e-5, help="lr per 256 images of effective batch")
    ap.add_argument("--min-lr", type=float, default=1e-6)
    ap.add_argument("--layer-decay", type=float, default=0.8)
    ap.add_argument("--weight-decay", type=float, default=1e-8)
    ap.add_argument("--drop-path", type=float, default=0.2)
    ap.add_argument("--clip-grad", type=float, default=5.0)
    ap.add_argument("--ema-decay", type=float, default=0.9999)
    ap.add_argument("--grad-ckpt", action="store_true")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--resume", default="")
    return ap.parse_args()


def layer_id_for_convnext(name, num_layers):
    # stem: 0, stage0: 1, stage1: 2, stage2 blocks grouped by 3: 3..11, stage3: 12, head: 13
    if name.startswith("stem"):
        return 0
    if name.startswith("stages"):
        stage = int(name.split(".")[1])
        if stage in (0, 1):
            return stage + 1
        if stage == 2:
            parts = name.split(".")
            if parts[2] == "blocks":
                return 3 + int(parts[3]) // 3
            return 3
        return num_layers - 2
    return num_layers - 1


def param_groups_lrd(model, weight_decay, layer_decay, num_layers=14):
    groups = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        no_decay = p.ndim == 1 or name.endswith(".bias")
        lid = layer_id_for_convnext(name, num_layers)
        key = f"layer_{lid}_{'no_decay' if no_decay else 'decay'}"
        if key not in groups:
            scale = layer_decay ** (num_layers - 1 - lid)
            groups[key] = {"params": [], "weight_decay": 0.0 if no_decay else weight_decay,
                           "lr_scale": scale}
        groups[key]["params"].append(p)
    return list(groups.values())


def forward_ckpt(net, x, use_ckpt):
    x = net.stem(x)
    for stage in net.stages:
        if use_ckpt and torch.is_grad_enabled():
            x = checkpoint(stage, x, use_reentrant=False)
        else:
            x = stage(x)
    x = net.norm_pre(x)
    return net.forward_head(x)


class Wrapped(nn.Module):
    def __init__(self, net, use_ckpt):
        super().__init__()
        self.net = net
        self.use_ckpt = use_ckpt

    def forward(self, x):
        return forward_ckpt(self.net, x, self.use_ckpt)


def load_pretrained(model, path):
    sd = torch.load(path, map_location="cpu")
    sd = sd.get("model", sd)
    sd = {k.replace("module.", "", 1) if k.startswith("module.") else k: v for k, v in sd.items()}
    # 22k head does not match the 1k head
    sd = {k: v for k, v in sd.items() if not k.startswith("head.fc")}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    return missing, unexpected


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    correct = torch.zeros((), device=device)
    total = torch.zeros((), device=device)
    for x, y in loader:
        x = x.to(device, non_blocking=True).to(memory_format=torch.channels_last)
        y = y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        correct += (logits.argmax(1) == y).sum()
        total += y.numel()
    dist.all_reduce(correct)
    dist.all_reduce(total)
    return (correct / total).item() * 100.0


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    master = rank == 0
    torch.manual_seed(1234 + rank)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    train_tf = create_transform(args.img_size, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                                re_prob=0.25, interpolation="bicubic")
    val_tf = create_transform(args.img_size, is_training=False, crop_pct=0.875, interpolation="bicubic")
    train_ds = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_ds = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)

    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=1234)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=64,
                            num_workers=args.workers, pin_memory=True)

    net = timm.create_model(args.model, num_classes=1000, drop_path_rate=args.drop_path)
    if args.pretrained and not args.resume:
        missing, _ = load_pretrained(net, args.pretrained)
        if master:
            print("missing keys:", missing)
    model = Wrapped(net, args.grad_ckpt).to(device, memory_format=torch.channels_last)
    model_ddp = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)
    ema = ModelEmaV2(model, decay=args.ema_decay)  # after DDP init: weights identical on all ranks

    eff_batch = args.batch_size * args.accum_iter * world
    lr = args.blr * eff_batch / 256
    groups = param_groups_lrd(model.net, args.weight_decay, args.layer_decay)
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999))
    steps_per_epoch = len(train_loader) // args.accum_iter
    sched = CosineLRScheduler(optimizer, t_initial=args.epochs * steps_per_epoch, lr_min=args.min_lr,
                              warmup_t=args.warmup_epochs * steps_per_epoch, warmup_lr_init=1e-7,
                              t_in_epochs=False)
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=1000)
    criterion = SoftTargetCrossEntropy()

    start_epoch, best = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        ema.module.load_state_dict(ckpt["ema"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt.get("best", 0.0)
    if master:
        os.makedirs(args.out, exist_ok=True)
        print(f"world {world}, effective batch {eff_batch}, peak lr {lr:.2e}")

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model_ddp.train()
        t0 = time.time()
        optimizer.zero_grad(set_to_none=True)
        for it, (x, y) in enumerate(train_loader):
            x = x.to(device, non_blocking=True).to(memory_format=torch.channels_last)
            y = y.to(device, non_blocking=True)
            x, y = mixup(x, y)
            boundary = (it + 1) % args.accum_iter == 0
            # skip the gradient all-reduce on intermediate micro steps
            ctx = nullcontext() if boundary else model_ddp.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = criterion(model_ddp(x), y)
                (loss / args.accum_iter).backward()
            if not boundary:
                continue
            nn.utils.clip_grad_norm_(model_ddp.parameters(), args.clip_grad)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            ema.update(model)
            step = epoch * steps_per_epoch + (it + 1) // args.accum_iter
            sched.step_update(num_updates=step)  # timm applies each group's lr_scale
            if master and step % 50 == 0:
                print(f"ep {epoch} it {it}/{len(train_loader)} loss {loss.item():.4f} "
                      f"lr {optimizer.param_groups[-1]['lr']:.2e}")

        acc = validate(model, val_loader, device)
        acc_ema = validate(ema.module, val_loader, device)
        best = max(best, acc, acc_ema)
        if master:
            print(f"epoch {epoch} acc {acc:.2f} ema {acc_ema:.2f} best {best:.2f} ({time.time() - t0:.0f}s)")
            torch.save({"model": model.state_dict(), "ema": ema.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "epoch": epoch, "best": best},
                       os.path.join(args.out, "last.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
