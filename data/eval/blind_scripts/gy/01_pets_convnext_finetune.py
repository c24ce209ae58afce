#!/usr/bin/env python3
"""
Fine-tune a timm ConvNeXt-Tiny on Oxford-IIIT Pets across the two desktops.

    box A (192.168.1.20): RTX 3080 10GB   <- master
    box B (192.168.1.31): RTX 3060 12GB

Both boxes have the dataset unpacked at ~/data/oxford-pets/{train,val}
(ImageFolder layout, made with scripts/split_pets.py).

Launch (one process per box):
    box A: torchrun --nnodes=2 --nproc_per_node=1 --node_rank=0 \
               --master_addr=192.168.1.20 --master_port=29500 train_pets.py
    box B: same with --node_rank=1
"""
import argparse
import json
import math
import os
import time
from pathlib import Path

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def parse_args():
    p = argparse.ArgumentParser(description="Oxford pets fine-tune (DDP)")
    p.add_argument("--data", default=os.path.expanduser("~/data/oxford-pets"))
    p.add_argument("--model", default="convnext_tiny.fb_in22k")
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=32, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-4, help="lr for a global batch of 64")
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--warmup-epochs", type=int, default=1)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--out", default="runs/pets")
    p.add_argument("--no-amp", action="store_true")
    return p.parse_args()


def setup():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return dist.get_rank(), dist.get_world_size(), local_rank


def build_loaders(args, world_size, rank):
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(args.img_size, scale=(0.35, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.ColorJitter(0.2, 0.2, 0.2),
        transforms.ToTensor(),
        transforms.Normalize(MEAN, STD),
    ])
    val_tf = transforms.Compose([
        transforms.Resize(int(args.img_size * 1.14)),
        transforms.CenterCrop(args.img_size),
        transforms.ToTensor(),
        transforms.Normalize(MEAN, STD),
    ])
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)

    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank,
                                       shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_set, num_replicas=world_size, rank=rank,
                                     shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size * 2, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)
    return train_set, train_loader, val_loader, train_sampler


def cosine_lr(step, total, warmup, base_lr):
    if step < warmup:
        return base_lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return base_lr * 0.5 * (1.0 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate(model, loader, device, use_amp):
    model.eval()
    crit = nn.CrossEntropyLoss(reduction="sum")
    loss_sum, correct, seen = 0.0, 0, 0
    for images, targets in loader:
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=use_amp):
            logits = model(images)
        loss_sum += crit(logits.float(), targets).item()
        correct += (logits.argmax(dim=1) == targets).sum().item()
        seen += targets.numel()
    return loss_sum / seen, correct / seen


def main():
    args = parse_args()
    rank, world_size, local_rank = setup()
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True
    is_main = rank == 0
    use_amp = not args.no_amp

    out_dir = Path(args.out)
    if is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        with open(out_dir / "args.json", "w") as f:
            json.dump(vars(args), f, indent=2)

    train_set, train_loader, val_loader, train_sampler = build_loaders(args, world_size, rank)
    num_classes = len(train_set.classes)

    model = timm.create_model(args.model, pretrained=True, num_classes=num_classes,
                              drop_path_rate=0.1)
    model.to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    global_batch = args.batch_size * world_size
    base_lr = args.lr * global_batch / 64
    optimizer = torch.optim.AdamW(model.parameters(), lr=base_lr,
                                  weight_decay=args.weight_decay)
    scaler = torch.cuda.amp.GradScaler(enabled=use_amp)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)

    steps_per_epoch = len(train_loader)
    total_steps = args.epochs * steps_per_epoch
    warmup_steps = args.warmup_epochs * steps_per_epoch
    if is_main:
        print(f"world={world_size} global_batch={global_batch} lr={base_lr:.2e} "
              f"classes={num_classes} steps/epoch={steps_per_epoch}", flush=True)

    best_acc = 0.0
    step = 0
    for epoch in range(args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for images, targets in train_loader:
            images = images.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            lr = cosine_lr(step, total_steps, warmup_steps, base_lr)
            for g in optimizer.param_groups:
                g["lr"] = lr

            with torch.autocast("cuda", dtype=torch.float16, enabled=use_amp):
                logits = model(images)
                loss = criterion(logits, targets)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()

            running[0] += loss.detach() * targets.size(0)
            running[1] += targets.size(0)
            step += 1

        dist.all_reduce(running)
        train_loss = (running[0] / running[1]).item()
        val_loss, val_acc = evaluate(model, val_loader, device, use_amp)

        if is_main:
            dt = time.time() - t0
            print(f"epoch {epoch:02d} | train {train_loss:.4f} | val {val_loss:.4f} "
                  f"| acc {val_acc * 100:.2f}% | {dt:.0f}s", flush=True)
            with open(out_dir / "log.jsonl", "a") as f:
                f.write(json.dumps({"epoch": epoch, "train_loss": train_loss,
                                    "val_loss": val_loss, "val_acc": val_acc}) + "\n")
            ckpt = {
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(),
                "epoch": epoch,
                "classes": train_set.classes,
            }
            torch.save(ckpt, out_dir / "last.pt")
            if val_acc > best_acc:
                best_acc = val_acc
                torch.save(ckpt, out_dir / "best.pt")
                print(f"  new best {best_acc * 100:.2f}%", flush=True)
        dist.barrier()

    if is_main:
        print(f"done, best val acc {best_acc * 100:.2f}%")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
