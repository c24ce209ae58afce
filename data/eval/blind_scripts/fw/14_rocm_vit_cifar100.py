#!/usr/bin/env python
"""Small ViT trained from scratch on CIFAR-100, on a 4x Radeon PRO W7900 workstation (ROCm 6.1).

    torchrun --standalone --nproc_per_node=4 14_rocm_vit_cifar100.py --epochs 200 --amp
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default=os.path.expanduser("~/datasets/cifar100"))
    p.add_argument("--ckpt-dir", default=os.path.expanduser("~/runs/vit_cifar100"))
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3, help="lr for a global batch of 512")
    p.add_argument("--wd", type=float, default=0.05)
    p.add_argument("--patch", type=int, default=4)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--depth", type=int, default=7)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--amp", action="store_true")
    return p.parse_args()


class Block(nn.Module):
    def __init__(self, dim, heads, mlp_ratio=4.0, drop=0.0):
        super().__init__()
        self.n1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=drop, batch_first=True)
        self.n2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, int(dim * mlp_ratio)), nn.GELU(),
                                 nn.Linear(int(dim * mlp_ratio), dim))

    def forward(self, x):
        h = self.n1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.n2(x))


class ViT(nn.Module):
    def __init__(self, img=32, patch=4, dim=384, depth=7, heads=6, num_classes=100):
        super().__init__()
        self.embed = nn.Conv2d(3, dim, patch, stride=patch)
        n = (img // patch) ** 2
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, n + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        x = self.embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.size(0), -1, -1), x], dim=1) + self.pos
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


def get_device():
    if torch.cuda.is_available():  # ROCm builds report HIP GPUs through torch.cuda
        return torch.device("cuda")
    return torch.device("cpu")


def main():
    args = get_args()
    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = get_device()
    torch.manual_seed(0)

    mean, std = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
    train_tf = transforms.Compose([
        transforms.RandomCrop(32, padding=4),
        transforms.RandomHorizontalFlip(),
        transforms.RandAugment(num_ops=2, magnitude=9),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
        transforms.RandomErasing(p=0.25),
    ])
    test_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])

    if rank == 0:
        datasets.CIFAR100(args.data, train=True, download=True)
        datasets.CIFAR100(args.data, train=False, download=True)
    dist.barrier()
    train_set = datasets.CIFAR100(args.data, train=True, transform=train_tf)
    test_set = datasets.CIFAR100(args.data, train=False, transform=test_tf)

    sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)), batch_size=500, num_workers=4)

    model = ViT(patch=args.patch, dim=args.dim, depth=args.depth, heads=args.heads).to(device)
    model = DDP(model)

    lr = args.lr * args.batch_size * world / 512
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.wd)
    steps = args.epochs * len(train_loader)
    warmup = 10 * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps,
                                                    pct_start=warmup / steps, anneal_strategy="cos")
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"params {n_params / 1e6:.2f}M  world {world}  lr {lr:.2e}", flush=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.float16, enabled=args.amp):
                loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()

        model.eval()
        correct = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in test_loader:
                x, y = x.to(device), y.to(device)
                with torch.autocast(device.type, dtype=torch.float16, enabled=args.amp):
                    pred = model.module(x).argmax(1)
                correct[0] += (pred == y).sum()
                correct[1] += y.numel()
        dist.all_reduce(correct)
        acc = (correct[0] / correct[1]).item()

        if rank == 0:
            print(f"epoch {epoch:3d} loss {loss.item():.3f} test acc {acc * 100:.2f}% {time.time() - t0:.0f}s",
                  flush=True)
            if acc > best:
                best = acc
                torch.save(model.module.state_dict(), os.path.join(args.ckpt_dir, "best.pt"))
            torch.save({"model": model.module.state_dict(), "opt": optimizer.state_dict(),
                        "sched": scheduler.state_dict(), "epoch": epoch},
                       os.path.join(args.ckpt_dir, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
