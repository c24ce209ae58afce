#!/usr/bin/env python3
# Fine-tune a pretrained ViT-B/16 on an ImageFolder dataset (e.g. Food-101, iNat mini).
#
#   torchrun --nproc_per_node=4 03_vit_finetune.py --data /datasets/food101 --epochs 30
#
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, transforms
from torchvision.models import ViT_B_16_Weights, vit_b_16
from torchvision.transforms import v2


def parse_args():
    parser = argparse.ArgumentParser(description="ViT fine-tuning")
    parser.add_argument("--data", type=str, required=True)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64, help="images per GPU")
    parser.add_argument("--base-lr", type=float, default=1e-4, help="lr for a total batch of 512")
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--warmup-epochs", type=int, default=2)
    parser.add_argument("--label-smoothing", type=float, default=0.1)
    parser.add_argument("--mixup", type=float, default=0.8)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--output", type=str, default="./output/vit_ft")
    parser.add_argument("--resume", type=str, default="")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


def build_loaders(args, world_size, rank):
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224, interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.RandomHorizontalFlip(),
        transforms.TrivialAugmentWide(),
        transforms.ToTensor(),
        transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
        transforms.RandomErasing(p=0.25),
    ])
    val_tf = transforms.Compose([
        transforms.Resize(256, interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.CenterCrop(224),
        transforms.ToTensor(),
        transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    ])
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)

    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    # no padding for val so every image is counted exactly once
    val_idx = list(range(rank, len(val_set), world_size))
    val_subset = torch.utils.data.Subset(val_set, val_idx)

    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_subset, batch_size=args.batch_size * 2, shuffle=False,
                            num_workers=args.workers, pin_memory=True)
    return train_loader, val_loader, train_sampler, len(train_set.classes)


def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # correct@1, correct@5, count
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        for images, targets in loader:
            images = images.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            logits = model(images)
            top5 = logits.topk(5, dim=1).indices
            stats[0] += (top5[:, 0] == targets).sum()
            stats[1] += (top5 == targets[:, None]).any(dim=1).sum()
            stats[2] += targets.numel()
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    model.train()
    return (stats[0] / stats[2]).item() * 100, (stats[1] / stats[2]).item() * 100


def main():
    args = parse_args()

    torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.benchmark = True

    train_loader, val_loader, train_sampler, num_classes = build_loaders(args, world_size, rank)

    model = vit_b_16(weights=ViT_B_16_Weights.IMAGENET1K_V1)
    model.heads.head = nn.Linear(model.heads.head.in_features, num_classes)
    nn.init.zeros_(model.heads.head.weight)
    nn.init.zeros_(model.heads.head.bias)
    model.to(device)
    raw_model = model

    lr = args.base_lr * args.batch_size * world_size / 512
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.weight_decay)
    steps_per_epoch = len(train_loader)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01,
                                               total_iters=args.warmup_epochs * steps_per_epoch)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, T_max=(args.epochs - args.warmup_epochs) * steps_per_epoch, eta_min=1e-6)
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine],
                                                      milestones=[args.warmup_epochs * steps_per_epoch])

    start_epoch, best_acc = 0, 0.0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume, map_location="cpu")
        raw_model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_acc = ckpt["epoch"] + 1, ckpt["best_acc"]

    model = DDP(model, device_ids=[args.local_rank])
    if args.compile:
        model = torch.compile(model)

    mixup = v2.MixUp(alpha=args.mixup, num_classes=num_classes) if args.mixup > 0 else None
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    writer = SummaryWriter(os.path.join(args.output, "tb")) if rank == 0 else None

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros(2, device=device)
        tic = time.time()
        for it, (images, targets) in enumerate(train_loader):
            images = images.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            if mixup is not None:
                images, targets = mixup(images, targets)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                outputs = model(images)
                loss = criterion(outputs, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            loss_sum[0] += loss.detach()
            loss_sum[1] += 1
            if rank == 0 and it % 100 == 0:
                print(f"[{epoch}][{it}/{steps_per_epoch}] loss {loss.item():.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.3e}", flush=True)

        dist.all_reduce(loss_sum)
        acc1, acc5 = evaluate(raw_model, val_loader, device)
        if rank == 0:
            train_loss = (loss_sum[0] / loss_sum[1]).item()
            print(f"epoch {epoch} train_loss {train_loss:.4f} acc@1 {acc1:.2f} acc@5 {acc5:.2f} "
                  f"time {time.time() - tic:.0f}s", flush=True)
            writer.add_scalar("train/loss", train_loss, epoch)
            writer.add_scalar("val/acc1", acc1, epoch)
            writer.add_scalar("val/acc5", acc5, epoch)
            is_best = acc1 > best_acc
            best_acc = max(acc1, best_acc)
            state = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch, "best_acc": best_acc,
                     "args": vars(args)}
            os.makedirs(args.output, exist_ok=True)
            torch.save(state, os.path.join(args.output, "checkpoint.pth"))
            if is_best:
                torch.save(state, os.path.join(args.output, "best.pth"))
                with open(os.path.join(args.output, "best.json"), "w") as f:
                    json.dump({"epoch": epoch, "acc1": acc1, "acc5": acc5}, f)
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
