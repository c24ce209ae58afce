#!/usr/bin/env python
"""FedAvg on CIFAR-10 with Dirichlet non-IID client partitions.

Every torchrun process plays one client. After each round the client models
are averaged with weights proportional to their local sample counts, so after
the all_reduce every rank holds the same global model.

    torchrun --nproc_per_node=8 01_fedavg_cifar10_dirichlet.py --alpha 0.3
"""
import argparse
import json
import logging
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.utils.data import DataLoader, Subset

logger = logging.getLogger("fedavg")

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


def parse_args():
    p = argparse.ArgumentParser(description="FedAvg / CIFAR-10 / Dirichlet split")
    p.add_argument("--data_dir", default="./data")
    p.add_argument("--out_dir", default="./runs/fedavg_cifar10")
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--local_epochs", type=int, default=2)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight_decay", type=float, default=5e-4)
    p.add_argument("--alpha", type=float, default=0.3, help="Dirichlet concentration")
    p.add_argument("--min_samples", type=int, default=20)
    p.add_argument("--eval_every", type=int, default=5)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--workers", type=int, default=4)
    return p.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def dirichlet_split(labels, n_clients, alpha, min_samples):
    """Label-skewed partition (Hsu et al. 2019). Resamples until every client
    has at least `min_samples` examples."""
    n_classes = int(labels.max()) + 1
    while True:
        client_idx = [[] for _ in range(n_clients)]
        for c in range(n_classes):
            idx_c = np.where(labels == c)[0]
            np.random.shuffle(idx_c)
            props = np.random.dirichlet(np.repeat(alpha, n_clients))
            cuts = (np.cumsum(props) * len(idx_c)).astype(int)[:-1]
            for k, part in enumerate(np.split(idx_c, cuts)):
                client_idx[k].extend(part.tolist())
        if min(len(ix) for ix in client_idx) >= min_samples:
            return client_idx


class CNN(nn.Module):
    """The 2-conv CNN from McMahan et al., with GroupNorm instead of BN."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 5, padding=2)
        self.gn1 = nn.GroupNorm(8, 64)
        self.conv2 = nn.Conv2d(64, 64, 5, padding=2)
        self.gn2 = nn.GroupNorm(8, 64)
        self.fc1 = nn.Linear(64 * 8 * 8, 384)
        self.fc2 = nn.Linear(384, 192)
        self.fc3 = nn.Linear(192, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.gn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.gn2(self.conv2(x))), 2)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def local_train(model, loader, args, device):
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                          weight_decay=args.weight_decay)
    total_loss, steps = 0.0, 0
    for _ in range(args.local_epochs):
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            total_loss += loss.item()
            steps += 1
    return total_loss / max(steps, 1)


@torch.no_grad()
def fedavg_aggregate(model, n_local, device):
    weight = torch.tensor(float(n_local), device=device)
    total = weight.clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    scale = (weight / total).item()
    for t in model.state_dict().values():
        if t.is_floating_point():
            t.mul_(scale)
            dist.all_reduce(t, op=dist.ReduceOp.SUM)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct, seen, loss_sum = 0, 0, 0.0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        out = model(x)
        loss_sum += F.cross_entropy(out, y, reduction="sum").item()
        correct += (out.argmax(1) == y).sum().item()
        seen += y.numel()
    return loss_sum / seen, correct / seen


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[%(asctime)s][client {rank}] %(message)s")
    # different seed per client so the local SGD noise is not correlated
    set_seed(args.seed + rank)

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        torchvision.datasets.CIFAR10(args.data_dir, train=True, download=True)
        torchvision.datasets.CIFAR10(args.data_dir, train=False, download=True)
    dist.barrier()

    train_tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(),
                          T.ToTensor(), T.Normalize(CIFAR_MEAN, CIFAR_STD)])
    test_tf = T.Compose([T.ToTensor(), T.Normalize(CIFAR_MEAN, CIFAR_STD)])
    train_set = torchvision.datasets.CIFAR10(args.data_dir, train=True, transform=train_tf)
    test_set = torchvision.datasets.CIFAR10(args.data_dir, train=False, transform=test_tf)

    labels = np.asarray(train_set.targets)
    partition = dirichlet_split(labels, world_size, args.alpha, args.min_samples)
    my_idx = partition[rank]
    n_local = len(my_idx)
    hist = np.bincount(labels[my_idx], minlength=10).tolist()
    logger.warning("client %d: %d samples, label histogram %s", rank, n_local, hist)

    train_loader = DataLoader(Subset(train_set, my_idx), batch_size=args.batch_size,
                              shuffle=True, num_workers=args.workers, pin_memory=True,
                              drop_last=False)
    test_loader = DataLoader(test_set, batch_size=512, shuffle=False,
                             num_workers=args.workers, pin_memory=True)

    model = CNN(num_classes=10).to(device)
    # start every client from the same global initialisation
    for t in model.state_dict().values():
        dist.broadcast(t, src=0)

    history = []
    best_acc = 0.0
    for rnd in range(1, args.rounds + 1):
        t0 = time.time()
        train_loss = local_train(model, train_loader, args, device)
        fedavg_aggregate(model, n_local, device)

        loss_t = torch.tensor(train_loss * n_local, device=device)
        dist.all_reduce(loss_t)
        avg_train_loss = loss_t.item() / len(train_set)

        if rank == 0:
            msg = {"round": rnd, "train_loss": round(avg_train_loss, 4),
                   "time": round(time.time() - t0, 1)}
            if rnd % args.eval_every == 0 or rnd == args.rounds:
                test_loss, test_acc = evaluate(model, test_loader, device)
                msg.update(test_loss=round(test_loss, 4), test_acc=round(test_acc, 4))
                if test_acc > best_acc:
                    best_acc = test_acc
                    torch.save({"round": rnd, "model": model.state_dict(), "acc": test_acc},
                               os.path.join(args.out_dir, "best.pt"))
            history.append(msg)
            logger.info(json.dumps(msg))
        dist.barrier()

    if rank == 0:
        with open(os.path.join(args.out_dir, "history.json"), "w") as f:
            json.dump(history, f, indent=1)
        logger.info("best test acc %.4f", best_acc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
