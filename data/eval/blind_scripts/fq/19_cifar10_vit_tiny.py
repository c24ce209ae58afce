"""
A small Vision Transformer (patch 4, dim 192, depth 9) trained from scratch on CIFAR-10.
DDP on a single node, workers started with torch.multiprocessing.spawn.

    python 19_cifar10_vit_tiny.py --world_size 8 --epochs 200 --eval_every 5
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


class PatchEmbed(nn.Module):
    def __init__(self, img=32, patch=4, dim=192):
        super().__init__()
        self.proj = nn.Conv2d(3, dim, patch, patch)
        self.n = (img // patch) ** 2

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class ViT(nn.Module):
    def __init__(self, num_classes=10, dim=192, depth=9, heads=12, mlp_ratio=2, dropout=0.0):
        super().__init__()
        self.patch = PatchEmbed(dim=dim)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.zeros(1, self.patch.n + 1, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, dim * mlp_ratio, dropout, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)
        nn.init.trunc_normal_(self.pos, std=0.02)
        nn.init.trunc_normal_(self.cls, std=0.02)

    def forward(self, x):
        x = self.patch(x)
        x = torch.cat([self.cls.expand(x.size(0), -1, -1), x], 1) + self.pos
        x = self.encoder(x)
        return self.head(self.norm(x[:, 0]))


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", default="./data")
    p.add_argument("--world_size", type=int, default=torch.cuda.device_count())
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--batch_size", type=int, default=128, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3, help="for a total batch of 512")
    p.add_argument("--warmup_epochs", type=int, default=10)
    p.add_argument("--eval_every", type=int, default=5)
    p.add_argument("--ckpt_dir", default="./vit_ckpt")
    p.add_argument("--port", default="29620")
    return p.parse_args()


def loaders(args, rank):
    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    train_tf = transforms.Compose([
        transforms.RandomCrop(32, padding=4),
        transforms.RandomHorizontalFlip(),
        transforms.AutoAugment(transforms.AutoAugmentPolicy.CIFAR10),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
        transforms.RandomErasing(p=0.25),
    ])
    test_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])
    train_ds = datasets.CIFAR10(args.data_dir, train=True, transform=train_tf)
    test_ds = datasets.CIFAR10(args.data_dir, train=False, transform=test_tf)
    train_sampler = DistributedSampler(train_ds, num_replicas=args.world_size, rank=rank, shuffle=True)
    test_sampler = DistributedSampler(test_ds, num_replicas=args.world_size, rank=rank, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                          num_workers=4, pin_memory=True, drop_last=True, persistent_workers=True)
    test_dl = DataLoader(test_ds, batch_size=256, sampler=test_sampler, num_workers=4, pin_memory=True)
    return train_dl, test_dl, train_sampler


def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            stats[0] += F.cross_entropy(logits, y, reduction="sum")
            stats[1] += (logits.argmax(1) == y).sum()
            stats[2] += y.numel()
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    model.train()
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def cosine_with_warmup(optimizer, warmup_steps, total_steps):
    import math

    def f(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        t = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * t))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, f)


def train(rank, args):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = args.port
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=args.world_size)
    device = torch.device(f"cuda:{rank}")
    torch.manual_seed(0)

    train_dl, test_dl, train_sampler = loaders(args, rank)
    model = DDP(ViT().to(device), device_ids=[rank])

    lr = args.lr * args.batch_size * args.world_size / 512
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    steps_per_epoch = len(train_dl)
    scheduler = cosine_with_warmup(optimizer, args.warmup_epochs * steps_per_epoch,
                                   args.epochs * steps_per_epoch)
    scaler = torch.cuda.amp.GradScaler()

    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.cuda.amp.autocast():
                loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()

        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs} last loss {loss.item():.4f} "
                  f"lr {scheduler.get_last_lr()[0]:.2e} ({time.time() - t0:.0f}s)")

        if rank == 0 and ((epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs):
            val_loss, val_acc = evaluate(model, test_dl, device)
            print(f"  val loss {val_loss:.4f} acc {val_acc * 100:.2f}%")
            if val_acc > best_acc:
                best_acc = val_acc
                torch.save({"epoch": epoch, "model": model.module.state_dict(), "acc": val_acc},
                           os.path.join(args.ckpt_dir, "vit_best.pth"))

    if rank == 0:
        print(f"best acc {best_acc * 100:.2f}%")
    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    os.makedirs(args.ckpt_dir, exist_ok=True)
    datasets.CIFAR10(args.data_dir, train=True, download=True)
    datasets.CIFAR10(args.data_dir, train=False, download=True)
    mp.spawn(train, args=(args,), nprocs=args.world_size, join=True)
