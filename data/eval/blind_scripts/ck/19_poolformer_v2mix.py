"""PoolFormer-S24 on ImageNet-1k, using torchvision.transforms.v2 MixUp/CutMix in the collate.

Keeps the best checkpoint by validation top-1.

    torchrun --nproc_per_node=8 19_poolformer_v2mix.py --data /scratch/imagenet --out /nfs/runs/poolformer_s24
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, default_collate
from torchvision import datasets
from torchvision.transforms import v2

import timm
from timm.data import create_transform
from timm.utils import ModelEmaV2


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="poolformer_s24")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--lr", type=float, default=4e-3, help="at global batch 4096")
    p.add_argument("--wd", type=float, default=0.05)
    p.add_argument("--drop-path", type=float, default=0.1)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--mixup", type=float, default=0.8)
    p.add_argument("--cutmix", type=float, default=1.0)
    p.add_argument("--ema-decay", type=float, default=0.9999)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--resume", default="")
    return p.parse_args()


class MixCollate:
    """Applies MixUp or CutMix (50/50) to a collated batch; targets become soft labels."""

    def __init__(self, num_classes, mixup_alpha, cutmix_alpha):
        self.mix = v2.RandomChoice([v2.MixUp(alpha=mixup_alpha, num_classes=num_classes),
                                    v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes)])

    def __call__(self, batch):
        return self.mix(*default_collate(batch))


def lr_at(step, total, warmup, base, min_lr=1e-6):
    if step < warmup:
        return base * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return min_lr + 0.5 * (base - min_lr) * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct, total = 0, 0
    for x, y in loader:
        x = x.to(device, non_blocking=True).to(memory_format=torch.channels_last)
        y = y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(x).argmax(dim=1)
        correct += (pred == y).sum().item()
        total += y.numel()
    return 100.0 * correct / max(total, 1)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(rank)

    train_tf = create_transform(224, is_training=True, auto_augment="rand-m9-mstd0.5-inc1", re_prob=0.25,
                                interpolation="bicubic")
    val_tf = create_transform(224, is_training=False, crop_pct=0.9, interpolation="bicubic")
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    num_classes = len(train_set.classes)

    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              collate_fn=MixCollate(num_classes, args.mixup, args.cutmix),
                              persistent_workers=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=256,
                            num_workers=args.workers, pin_memory=True)

    model = timm.create_model(args.model, num_classes=num_classes, drop_path_rate=args.drop_path)
    model = model.to(device, memory_format=torch.channels_last)
    ddp = DDP(model, device_ids=[local_rank])
    ema = ModelEmaV2(model, decay=args.ema_decay)

    base_lr = args.lr * args.batch_size * world / 4096
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim <= 1 or n.endswith(".bias") else decay).append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=base_lr)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    steps_per_epoch = len(train_loader)
    total_steps = args.epochs * steps_per_epoch
    warmup_steps = args.warmup_epochs * steps_per_epoch

    start_epoch, best_acc = 0, 0.0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ck["model"])
        ema.module.load_state_dict(ck["ema"])
        optimizer.load_state_dict(ck["optimizer"])
        start_epoch, best_acc = ck["epoch"] + 1, ck["best_acc"]
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        ddp.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_loader):
            step = epoch * steps_per_epoch + i
            for g in optimizer.param_groups:
                g["lr"] = lr_at(step, total_steps, warmup_steps, base_lr)
            x = x.to(device, non_blocking=True).to(memory_format=torch.channels_last)
            y = y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(ddp(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            ema.update(model)
            if rank == 0 and i % 100 == 0:
                print(f"epoch {epoch} [{i}/{steps_per_epoch}] loss {loss.item():.4f} "
                      f"lr {optimizer.param_groups[0]['lr']:.2e}", flush=True)

        acc = evaluate(model, val_loader, device)
        ema_acc = evaluate(ema.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: top1 {acc:.2f}  ema top1 {ema_acc:.2f}  ({time.time() - t0:.0f}s)", flush=True)
            state = {"model": model.state_dict(), "ema": ema.module.state_dict(),
                     "optimizer": optimizer.state_dict(), "epoch": epoch, "best_acc": max(best_acc, ema_acc)}
            torch.save(state, os.path.join(args.out, "last.pth"))
            if ema_acc > best_acc:
                best_acc = ema_acc
                torch.save(state, os.path.join(args.out, "best.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
