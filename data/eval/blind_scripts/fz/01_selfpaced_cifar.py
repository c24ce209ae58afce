#!/usr/bin/env python
"""Self-paced learning (SPL) on CIFAR-100 with DDP.

Every epoch after the warm-up we score the training set with the current model,
keep the samples whose loss is below the age parameter lambda and train only on
those. lambda grows geometrically, so harder samples are admitted over time.

    torchrun --nproc_per_node=4 01_selfpaced_cifar.py --data /data/cifar100 --out runs/spl
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

CIFAR_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR_STD = (0.2673, 0.2564, 0.2762)


class IndexedDataset(Dataset):
    """Returns (image, label, index) so per-sample losses can be tracked."""

    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        return x, y, i


def parse_args():
    p = argparse.ArgumentParser(description="Self-paced learning, CIFAR-100")
    p.add_argument("--data", default="./data")
    p.add_argument("--out", default="./runs/spl")
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--lr", type=float, default=0.1, help="for a global batch of 256")
    p.add_argument("--wd", type=float, default=5e-4)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--lam0", type=float, default=1.0, help="initial SPL age parameter")
    p.add_argument("--mu", type=float, default=1.15, help="lambda growth per epoch")
    p.add_argument("--spl-warmup", type=int, default=5, help="epochs on the full set first")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def build_model(num_classes=100):
    m = torchvision.models.resnet18(num_classes=num_classes)
    # CIFAR stem: 3x3 conv, no max-pool
    m.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    m.maxpool = nn.Identity()
    return m


def build_datasets(root, rank):
    train_tf = T.Compose([
        T.RandomCrop(32, padding=4),
        T.RandomHorizontalFlip(),
        T.ToTensor(),
        T.Normalize(CIFAR_MEAN, CIFAR_STD),
    ])
    test_tf = T.Compose([T.ToTensor(), T.Normalize(CIFAR_MEAN, CIFAR_STD)])
    # download once, then everybody reads the extracted files
    if rank == 0:
        torchvision.datasets.CIFAR100(root, train=True, download=True)
        torchvision.datasets.CIFAR100(root, train=False, download=True)
    dist.barrier()
    train = torchvision.datasets.CIFAR100(root, train=True, transform=train_tf)
    score = torchvision.datasets.CIFAR100(root, train=True, transform=test_tf)
    test = torchvision.datasets.CIFAR100(root, train=False, transform=test_tf)
    return IndexedDataset(train), IndexedDataset(score), test


@torch.no_grad()
def score_pass(model, loader, device):
    """Per-sample loss on the un-augmented training images."""
    model.eval()
    all_idx, all_loss = [], []
    for x, y, idx in loader:
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float(), y, reduction="none")
        all_idx.append(idx)
        all_loss.append(loss.cpu())
    return torch.cat(all_idx), torch.cat(all_loss)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = torch.zeros((), device=device)
    total = torch.zeros((), device=device)
    for x, y in loader:
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        correct += (logits.argmax(1) == y).sum()
        total += y.numel()
    dist.all_reduce(correct)
    dist.all_reduce(total)
    return (correct / total).item()


def train_one_epoch(model, loader, optimizer, device):
    model.train()
    running = torch.zeros(2, device=device)
    for x, y, _ in loader:
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
            loss = F.cross_entropy(logits, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        running[0] += loss.detach() * y.size(0)
        running[1] += y.size(0)
    dist.all_reduce(running)
    return (running[0] / running[1].clamp(min=1)).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.benchmark = True

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    train_set, score_set, test_set = build_datasets(args.data, rank)

    score_loader = DataLoader(score_set, batch_size=512, num_workers=args.workers, pin_memory=True,
                              sampler=DistributedSampler(score_set, shuffle=False))
    # unpadded shard for evaluation so every test image is counted once
    test_shard = Subset(test_set, list(range(rank, len(test_set), world_size)))
    test_loader = DataLoader(test_shard, batch_size=512, num_workers=args.workers, pin_memory=True)
    full_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)

    model = build_model().to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])

    lr = args.lr * args.batch_size * world_size / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=args.wd, nesterov=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    lam = args.lam0
    best_acc = 0.0
    for epoch in range(args.epochs):
        t0 = time.time()
        if epoch < args.spl_warmup:
            full_sampler.set_epoch(epoch)
            loader = DataLoader(train_set, batch_size=args.batch_size, sampler=full_sampler,
                                num_workers=args.workers, pin_memory=True, drop_last=True)
            kept = torch.tensor([len(full_sampler)], device=device)
        else:
            idx, losses = score_pass(model.module, score_loader, device)
            keep = idx[losses < lam]
            loader = DataLoader(Subset(train_set, keep.tolist()), batch_size=args.batch_size, shuffle=True,
                                num_workers=args.workers, pin_memory=True, drop_last=True)
            kept = torch.tensor([keep.numel()], device=device)
            lam *= args.mu
        dist.all_reduce(kept)

        train_loss = train_one_epoch(model, loader, optimizer, device)
        scheduler.step()
        acc = evaluate(model.module, test_loader, device)

        if rank == 0:
            frac = kept.item() / len(train_set)
            print(f"epoch {epoch:3d} | lam {lam:.3f} | kept {frac:.3f} | loss {train_loss:.4f} "
                  f"| acc {acc:.4f} | {time.time() - t0:.0f}s", flush=True)
            state = {
                "epoch": epoch,
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "lam": lam,
                "acc": acc,
            }
            torch.save(state, os.path.join(args.out, "last.pt"))
            if acc > best_acc:
                best_acc = acc
                torch.save(state, os.path.join(args.out, "best.pt"))

    if rank == 0:
        print(f"best top-1 {best_acc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
