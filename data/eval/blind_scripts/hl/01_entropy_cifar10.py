#!/usr/bin/env python3
"""Pool-based active learning on CIFAR-10 with entropy sampling (DDP).

Every round we train a ResNet-18 from scratch on the current labelled set,
score the unlabelled pool with predictive entropy (the pool is sharded over
ranks), gather the scores and move the top-`budget` images into the labelled
set.

    torchrun --standalone --nproc_per_node=4 01_entropy_cifar10.py --rounds 10
"""
import argparse
import json
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchvision import datasets, transforms
from torchvision.models import resnet18

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


def parse_args():
    p = argparse.ArgumentParser(description="Entropy-based active learning")
    p.add_argument("--data_dir", default="./data")
    p.add_argument("--out_dir", default="./runs/al_entropy")
    p.add_argument("--init_size", type=int, default=1000)
    p.add_argument("--budget", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch_size", type=int, default=128, help="global batch size")
    p.add_argument("--score_batch_size", type=int, default=512)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--wd", type=float, default=5e-4)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def setup_distributed():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return dist.get_rank(), dist.get_world_size(), torch.device("cuda", local_rank)


def cifar_resnet18(num_classes=10):
    m = resnet18(num_classes=num_classes)
    m.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    m.maxpool = nn.Identity()
    return m


class IndexedSubset(Dataset):
    """Subset that also returns the index of the sample in the full dataset."""

    def __init__(self, base, indices):
        self.base = base
        self.indices = list(indices)

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        idx = self.indices[i]
        x, y = self.base[idx]
        return x, y, idx


def build_datasets(data_dir):
    train_tf = transforms.Compose([
        transforms.RandomCrop(32, padding=4),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(CIFAR_MEAN, CIFAR_STD),
    ])
    test_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(CIFAR_MEAN, CIFAR_STD)])
    train = datasets.CIFAR10(data_dir, train=True, transform=train_tf)
    pool_view = datasets.CIFAR10(data_dir, train=True, transform=test_tf)  # same images, no augmentation
    test = datasets.CIFAR10(data_dir, train=False, transform=test_tf)
    return train, pool_view, test


def train_round(model, loader, sampler, args, device):
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9,
                          weight_decay=args.wd, nesterov=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    model.train()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y, _ in loader:
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sched.step()
    return loss.item()


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    correct = torch.zeros(1, device=device)
    total = torch.zeros(1, device=device)
    for x, y in loader:
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        correct += (net(x).argmax(1) == y).sum()
        total += y.numel()
    dist.all_reduce(correct)
    dist.all_reduce(total)
    return (correct / total).item()


@torch.no_grad()
def entropy_scores(net, pool_view, pool_idx, args, device, rank, world_size):
    ds = IndexedSubset(pool_view, pool_idx)
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=False)
    loader = DataLoader(ds, batch_size=args.score_batch_size, sampler=sampler,
                        num_workers=args.workers, pin_memory=True)
    net.eval()
    scores, idxs = [], []
    for x, _, idx in loader:
        probs = F.softmax(net(x.to(device, non_blocking=True)), dim=1)
        ent = -(probs * torch.log(probs.clamp_min(1e-12))).sum(dim=1)
        scores.append(ent)
        idxs.append(idx.to(device))
    scores = torch.cat(scores)
    idxs = torch.cat(idxs)
    all_scores = [torch.empty_like(scores) for _ in range(world_size)]
    all_idxs = [torch.empty_like(idxs) for _ in range(world_size)]
    dist.all_gather(all_scores, scores)
    dist.all_gather(all_idxs, idxs)
    return torch.cat(all_scores).cpu(), torch.cat(all_idxs).cpu()


def select_top(scores, idxs, k):
    # the sampler pads the last shard with repeated samples, skip duplicates
    order = torch.argsort(scores, descending=True).tolist()
    chosen, seen = [], set()
    for j in order:
        i = int(idxs[j])
        if i in seen:
            continue
        seen.add(i)
        chosen.append(i)
        if len(chosen) == k:
            break
    return chosen


def main():
    args = parse_args()
    rank, world_size, device = setup_distributed()
    seed_everything(args.seed + rank)  # different augmentation streams per rank
    is_main = rank == 0

    if is_main:
        os.makedirs(args.out_dir, exist_ok=True)
        datasets.CIFAR10(args.data_dir, train=True, download=True)
        datasets.CIFAR10(args.data_dir, train=False, download=True)
    dist.barrier()

    train_set, pool_view, test_set = build_datasets(args.data_dir)
    n_train = len(train_set)
    labelled = np.random.choice(n_train, args.init_size, replace=False).tolist()

    test_sampler = DistributedSampler(test_set, shuffle=False)
    test_loader = DataLoader(test_set, batch_size=256, sampler=test_sampler,
                             num_workers=args.workers, pin_memory=True)
    per_gpu_bs = args.batch_size // world_size
    history = []

    for rnd in range(args.rounds + 1):
        t0 = time.time()
        labelled_set = set(labelled)
        pool = [i for i in range(n_train) if i not in labelled_set]

        model = cifar_resnet18().to(device)
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        model = DDP(model, device_ids=[device.index])

        train_ds = IndexedSubset(train_set, labelled)
        train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
        train_loader = DataLoader(train_ds, batch_size=per_gpu_bs, sampler=train_sampler,
                                  num_workers=args.workers, pin_memory=True, drop_last=False)
        last_loss = train_round(model, train_loader, train_sampler, args, device)
        acc = evaluate(model.module, test_loader, device)

        if is_main:
            history.append({"round": rnd, "n_labelled": len(labelled), "test_acc": acc,
                            "train_loss": last_loss, "time": time.time() - t0})
            print(f"[round {rnd}] labelled={len(labelled)} acc={acc:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.module.state_dict(), "labelled": labelled, "round": rnd},
                       os.path.join(args.out_dir, f"round_{rnd:02d}.pt"))
            with open(os.path.join(args.out_dir, "history.json"), "w") as f:
                json.dump(history, f, indent=2)

        if rnd == args.rounds:
            break

        scores, idxs = entropy_scores(model.module, pool_view, pool, args, device, rank, world_size)
        new = select_top(scores, idxs, args.budget)
        labelled = labelled + new
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
