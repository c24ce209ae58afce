"""
DeiT-Small from scratch on ImageNet-1k (ImageFolder layout) with DDP.

    torchrun --nnodes=1 --nproc_per_node=8 17_deit_imagenet_ddp.py --data /datasets/imagenet \
        --epochs 300 --batch-size 128
"""
import argparse
import datetime
import math
import os
import random
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from tqdm import tqdm


def get_args():
    parser = argparse.ArgumentParser("DeiT-S training")
    parser.add_argument("--data", required=True)
    parser.add_argument("--model", default="deit_small_patch16_224")
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=128, help="per GPU")
    parser.add_argument("--blr", type=float, default=5e-4, help="base lr for batch 512")
    parser.add_argument("--min-lr", type=float, default=1e-5)
    parser.add_argument("--warmup-epochs", type=int, default=5)
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--drop-path", type=float, default=0.1)
    parser.add_argument("--log-interval", type=int, default=100)
    parser.add_argument("--workers", type=int, default=10)
    parser.add_argument("--output-dir", default="output/deit_s")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def setup_distributed():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", timeout=datetime.timedelta(minutes=30))
    return local_rank


def cleanup():
    dist.destroy_process_group()


def is_main_process():
    return dist.get_rank() == 0


def reduce_tensor(t):
    """Average a tensor over all ranks."""
    rt = t.clone()
    dist.all_reduce(rt, op=dist.ReduceOp.SUM)
    return rt / dist.get_world_size()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def adjust_lr(optimizer, epoch_f, args, peak_lr):
    if epoch_f < args.warmup_epochs:
        lr = peak_lr * epoch_f / args.warmup_epochs
    else:
        progress = (epoch_f - args.warmup_epochs) / (args.epochs - args.warmup_epochs)
        lr = args.min_lr + (peak_lr - args.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))
    for g in optimizer.param_groups:
        g["lr"] = lr
    return lr


def build_loaders(args):
    train_tf = create_transform(224, is_training=True, color_jitter=0.4,
                                auto_augment="rand-m9-mstd0.5-inc1", interpolation="bicubic",
                                re_prob=0.25, re_mode="pixel", re_count=1)
    val_tf = transforms.Compose([
        transforms.Resize(256, interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.CenterCrop(224),
        transforms.ToTensor(),
        transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    ])
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    # 50k val images split evenly over 8 GPUs
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=256, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)
    return train_loader, val_loader, train_sampler


def train_one_epoch(model, loader, mixup_fn, criterion, optimizer, scaler, epoch, args, peak_lr, device):
    model.train()
    n_steps = len(loader)
    start = time.time()
    for step, (images, targets) in enumerate(tqdm(loader, disable=not is_main_process(), leave=False)):
        lr = adjust_lr(optimizer, epoch + step / n_steps, args, peak_lr)
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        images, targets = mixup_fn(images, targets)

        with torch.autocast("cuda", dtype=torch.float16):
            loss = criterion(model(images), targets)

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        scaler.step(optimizer)
        scaler.update()

        if is_main_process() and step % args.log_interval == 0:
            avg_loss = reduce_tensor(loss.detach())
            elapsed = time.time() - start
            print(f"epoch {epoch} [{step}/{n_steps}] loss {avg_loss.item():.4f} lr {lr:.2e} "
                  f"gnorm {grad_norm.item():.2f} {elapsed / (step + 1):.3f}s/it", flush=True)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    metrics = torch.zeros(3, device=device)
    for images, targets in loader:
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(images)
        top5 = logits.topk(5, 1).indices
        metrics[0] += (top5[:, 0] == targets).sum()
        metrics[1] += (top5 == targets[:, None]).any(1).sum()
        metrics[2] += targets.numel()
    dist.all_reduce(metrics)
    return (metrics[0] / metrics[2] * 100).item(), (metrics[1] / metrics[2] * 100).item()


def main():
    args = get_args()
    local_rank = setup_distributed()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    seed_everything(args.seed + dist.get_rank())

    train_loader, val_loader, train_sampler = build_loaders(args)
    mixup_fn = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=1000)

    model = timm.create_model(args.model, pretrained=False, num_classes=1000,
                              drop_path_rate=args.drop_path).to(device)
    model = DDP(model, device_ids=[local_rank])

    peak_lr = args.blr * args.batch_size * world_size / 512
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak_lr, weight_decay=args.weight_decay)
    scaler = torch.cuda.amp.GradScaler()
    criterion = SoftTargetCrossEntropy()

    if is_main_process():
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"world {world_size} | global batch {args.batch_size * world_size} | peak lr {peak_lr:.2e}")

    best_top1 = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        train_one_epoch(model, train_loader, mixup_fn, criterion, optimizer, scaler,
                        epoch, args, peak_lr, device)
        top1, top5 = evaluate(model, val_loader, device)
        if is_main_process():
            print(f"== epoch {epoch}: top1 {top1:.2f} top5 {top5:.2f} "
                  f"({(time.time() - t0) / 60:.1f} min)", flush=True)
            ckpt = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "scaler": scaler.state_dict(), "epoch": epoch, "args": vars(args)}
            torch.save(ckpt, os.path.join(args.output_dir, "checkpoint.pth"))
            if top1 > best_top1:
                best_top1 = top1
                torch.save(ckpt, os.path.join(args.output_dir, "best.pth"))
        dist.barrier()

    if is_main_process():
        print(f"best top1 {best_top1:.2f}")
    cleanup()


if __name__ == "__main__":
    main()
