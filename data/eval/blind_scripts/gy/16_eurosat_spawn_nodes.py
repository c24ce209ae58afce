#!/usr/bin/env python3
"""
EuroSAT RGB land-cover classification (10 classes, 27k 64x64 tiles),
ResNet-18 from torchvision, mp.spawn version so I can start it with plain python
on each machine.

Machines: 'atlas' 192.168.1.30 (RTX 3070) and 'boreas' 192.168.1.31 (RTX 2080).

  atlas : python eurosat_ddp.py --nodes 2 --node-rank 0 --master-addr 192.168.1.30
  boreas: python eurosat_ddp.py --nodes 2 --node-rank 1 --master-addr 192.168.1.30
"""
import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, models, transforms


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=os.path.expanduser("~/data/EuroSAT_RGB"))
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--node-rank", type=int, default=0)
    ap.add_argument("--master-addr", default="127.0.0.1")
    ap.add_argument("--master-port", type=int, default=23456)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--val-frac", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default="eurosat_r18.pt")
    return ap.parse_args()


def split_indices(n, val_frac, seed):
    rng = np.random.RandomState(seed)
    perm = rng.permutation(n)
    n_val = int(n * val_frac)
    return perm[n_val:].tolist(), perm[:n_val].tolist()


def make_model(num_classes):
    net = models.resnet18(weights=models.ResNet18_Weights.IMAGENET1K_V1)
    net.fc = nn.Linear(net.fc.in_features, num_classes)
    return net


def train(gpu, ngpus, world_size, args):
    rank = args.node_rank * ngpus + gpu
    torch.cuda.set_device(gpu)
    dist.init_process_group(backend="nccl",
                            init_method=f"tcp://{args.master_addr}:{args.master_port}",
                            world_size=world_size, rank=rank)
    device = torch.device("cuda", gpu)
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    mean, std = [0.344, 0.380, 0.408], [0.203, 0.137, 0.116]
    train_tf = transforms.Compose([
        transforms.Resize(96),
        transforms.RandomHorizontalFlip(),
        transforms.RandomVerticalFlip(),
        transforms.RandomApply([transforms.RandomRotation(90)], p=0.5),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    val_tf = transforms.Compose([transforms.Resize(96), transforms.ToTensor(), transforms.Normalize(mean, std)])
    full_train = datasets.ImageFolder(args.data, transform=train_tf)
    full_val = datasets.ImageFolder(args.data, transform=val_tf)
    tr_idx, va_idx = split_indices(len(full_train), args.val_frac, args.seed)
    train_set = Subset(full_train, tr_idx)
    val_set = Subset(full_val, va_idx)

    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=256, shuffle=False, num_workers=4)

    model = make_model(len(full_train.classes)).to(device)
    model = DDP(model, device_ids=[gpu])
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, epochs=args.epochs,
                                                    steps_per_epoch=len(train_loader))

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        total = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            total += torch.stack([loss.detach() * y.size(0), torch.tensor(float(y.size(0)), device=device)])
        dist.all_reduce(total)

        if rank == 0:
            model.eval()
            correct = seen = 0
            with torch.no_grad():
                for x, y in val_loader:
                    x, y = x.to(device), y.to(device)
                    correct += (model.module(x).argmax(1) == y).sum().item()
                    seen += y.size(0)
            acc = correct / seen
            print(f"epoch {epoch + 1}/{args.epochs} loss {(total[0] / total[1]).item():.4f} "
                  f"val acc {acc:.4f} ({time.time() - t0:.1f}s)", flush=True)
            if acc > best:
                best = acc
                torch.save({"model": model.module.state_dict(), "classes": full_train.classes,
                            "acc": acc}, args.out)
        dist.barrier()

    dist.destroy_process_group()


def main():
    args = parse_args()
    ngpus = torch.cuda.device_count()
    world_size = ngpus
    print(f"node {args.node_rank}: {ngpus} GPU(s), world size {world_size}")
    mp.spawn(train, args=(ngpus, world_size, args), nprocs=ngpus, join=True)


if __name__ == "__main__":
    main()
