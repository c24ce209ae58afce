#!/usr/bin/env python
"""ViT-B/16 fine-tuning on Food-101 with Intel GPU Max 1550 (XPU), oneCCL backend.

    source /opt/intel/oneapi/setvars.sh
    torchrun --nnodes=1 --nproc_per_node=8 08_xpu_vit_food101.py \
        --data-root /scratch/datasets --out-dir /home/$USER/proj/vit_food101
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from torchvision.models import vit_b_16, ViT_B_16_Weights

import intel_extension_for_pytorch as ipex
import oneccl_bindings_for_pytorch  # noqa: F401


def parse_args():
    parser = argparse.ArgumentParser(description="ViT Food-101 on XPU")
    parser.add_argument("--data-root", default="/scratch/datasets")
    parser.add_argument("--out-dir", default="./vit_food101")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per tile")
    parser.add_argument("--lr", type=float, default=1e-4, help="base lr at global batch 256")
    parser.add_argument("--warmup-epochs", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--log-interval", type=int, default=50)
    return parser.parse_args()


def build_data(args, rank, world_size):
    weights = ViT_B_16_Weights.IMAGENET1K_V1
    mean, std = weights.transforms().mean, weights.transforms().std
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224),
        transforms.RandomHorizontalFlip(),
        transforms.TrivialAugmentWide(),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    test_tf = transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), transforms.Normalize(mean, std),
    ])
    # Food101 is already unpacked under data-root; no download here
    train_ds = datasets.Food101(args.data_root, split="train", transform=train_tf)
    test_ds = datasets.Food101(args.data_root, split="test", transform=test_tf)
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                          num_workers=args.workers, pin_memory=True, drop_last=True)
    test_dl = DataLoader(Subset(test_ds, range(rank, len(test_ds), world_size)), batch_size=64,
                         num_workers=args.workers)
    return train_dl, test_dl, train_sampler


def cosine_with_warmup(optimizer, warmup_steps, total_steps):
    def fn(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return 0.5 * (1 + math.cos(math.pi * (step - warmup_steps) / max(1, total_steps - warmup_steps)))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


@torch.no_grad()
def test(model, loader, device):
    model.eval()
    counts = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        with torch.xpu.amp.autocast(dtype=torch.bfloat16):
            pred = model(x).argmax(1)
        counts[0] += (pred == y).sum()
        counts[1] += y.numel()
    dist.all_reduce(counts)
    model.train()
    return (counts[0] / counts[1]).item()


def main():
    args = parse_args()
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])

    device = torch.device(f"xpu:{args.local_rank}")
    torch.xpu.set_device(device)
    dist.init_process_group(backend="ccl", rank=rank, world_size=world_size)

    train_dl, test_dl, train_sampler = build_data(args, rank, world_size)

    model = vit_b_16(weights=ViT_B_16_Weights.IMAGENET1K_V1)
    model.heads.head = nn.Linear(model.heads.head.in_features, 101)
    model = model.to(device)

    lr = args.lr * args.batch_size * world_size / 256
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    model, optimizer = ipex.optimize(model, optimizer=optimizer, dtype=torch.bfloat16)
    model = DDP(model, device_ids=[device])

    steps_per_epoch = len(train_dl)
    scheduler = cosine_with_warmup(optimizer, int(args.warmup_epochs * steps_per_epoch), args.epochs * steps_per_epoch)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        print(f"world_size={world_size} lr={lr:.2e} steps/epoch={steps_per_epoch}", flush=True)

    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for i, (x, y) in enumerate(train_dl):
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            with torch.xpu.amp.autocast(dtype=torch.bfloat16):
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if rank == 0 and i % args.log_interval == 0:
                print(f"epoch {epoch} [{i}/{steps_per_epoch}] loss {loss.item():.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e}", flush=True)

        acc = test(model.module, test_dl, device)
        if rank == 0:
            print(f"epoch {epoch} test acc {acc:.4f} ({time.time() - tic:.0f}s)", flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict()},
                       os.path.join(args.out_dir, "checkpoint.pt"))
            if acc > best_acc:
                best_acc = acc
                torch.save(model.module.state_dict(), os.path.join(args.out_dir, "best.pt"))
        dist.barrier()

    if rank == 0:
        print(f"best test acc {best_acc:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
