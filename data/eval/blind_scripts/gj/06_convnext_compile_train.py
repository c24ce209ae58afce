"""ConvNeXt-T on ImageNet-1k: DDP, bf16 autocast, torch.compile on the DDP module.

    torchrun --nproc_per_node=8 convnext_compile_train.py \
        --train-dir /datasets/imagenet/train --val-dir /datasets/imagenet/val --out /checkpoints/convnext_t
"""
import argparse
import logging
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch._dynamo
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

logger = logging.getLogger("convnext")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-dir", required=True)
    p.add_argument("--val-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--arch", default="convnext_tiny")
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--lr", type=float, default=4e-3, help="peak lr for a global batch of 4096")
    p.add_argument("--wd", type=float, default=0.05)
    p.add_argument("--warmup-epochs", type=int, default=20)
    p.add_argument("--workers", type=int, default=12)
    p.add_argument("--resume", default="")
    return p.parse_args()


def make_loaders(args, world_size, rank):
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224, interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.RandomHorizontalFlip(),
        transforms.RandAugment(num_ops=2, magnitude=9),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
        transforms.RandomErasing(p=0.25),
    ])
    val_tf = transforms.Compose([
        transforms.Resize(236, interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.CenterCrop(224),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    train_ds = datasets.ImageFolder(args.train_dir, train_tf)
    val_ds = datasets.ImageFolder(args.val_dir, val_tf)
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, num_replicas=world_size, rank=rank, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True, prefetch_factor=4)
    val_loader = DataLoader(val_ds, batch_size=256, sampler=val_sampler, num_workers=args.workers, pin_memory=True)
    return train_loader, val_loader, train_sampler


def train_one_epoch(model, loader, optimizer, scheduler, mixup, criterion, device, epoch, rank):
    model.train()
    meter = torch.zeros(2, device=device)
    end = time.time()
    for i, (images, targets) in enumerate(loader):
        images = images.to(device, non_blocking=True).to(memory_format=torch.channels_last)
        targets = targets.to(device, non_blocking=True)
        images, targets = mixup(images, targets)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = criterion(model(images), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        meter += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        if rank == 0 and i % 200 == 0:
            logger.info("epoch %d [%d/%d] loss %.4f lr %.3e %.3fs/it", epoch, i, len(loader), loss.item(),
                        optimizer.param_groups[0]["lr"], (time.time() - end) / max(i, 1))
    dist.all_reduce(meter)
    return (meter[0] / meter[1]).item()


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)
    for images, targets in loader:
        images = images.to(device, non_blocking=True).to(memory_format=torch.channels_last)
        targets = targets.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(images)
        top5 = out.topk(5, dim=1).indices
        stats[0] += (top5[:, 0] == targets).sum()
        stats[1] += (top5 == targets[:, None]).any(dim=1).sum()
        stats[2] += targets.numel()
    dist.all_reduce(stats)
    return (100 * stats[0] / stats[2]).item(), (100 * stats[1] / stats[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = True

    train_loader, val_loader, train_sampler = make_loaders(args, world_size, rank)

    model = timm.create_model(args.arch, num_classes=1000, drop_path_rate=0.1)
    model.to(device, memory_format=torch.channels_last)
    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        start_epoch = ckpt["epoch"] + 1

    raw_model = model
    model = DDP(model, device_ids=[local_rank], broadcast_buffers=False, gradient_as_bucket_view=True)
    torch._dynamo.config.optimize_ddp = True
    model = torch.compile(model)

    global_bs = args.batch_size * world_size
    lr = args.lr * global_bs / 4096
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.wd, fused=True)
    iters = len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=lr, total_steps=args.epochs * iters, pct_start=args.warmup_epochs / args.epochs,
        anneal_strategy="cos", div_factor=1e3, final_div_factor=1e2)
    if args.resume:
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        del ckpt

    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=1000)
    criterion = SoftTargetCrossEntropy()

    best = 0.0
    for epoch in range(start_epoch, args.epochs):
        t0 = time.time()
        train_loss = train_one_epoch(model, train_loader, optimizer, scheduler, mixup, criterion, device, epoch, rank)
        top1, top5 = validate(model, val_loader, device)
        if rank == 0:
            logger.info("epoch %d train_loss %.4f top1 %.2f top5 %.2f (%.0fs, %.0f img/s)", epoch, train_loss, top1,
                        top5, time.time() - t0, iters * global_bs / (time.time() - t0))
            state = {
                "model": raw_model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "epoch": epoch,
                "top1": top1,
            }
            os.makedirs(args.out, exist_ok=True)
            torch.save(state, os.path.join(args.out, "checkpoint.pth"))
            if top1 > best:
                best = top1
                torch.save(state, os.path.join(args.out, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
