#!/usr/bin/env python3
# FedAvg with partial client participation on Fashion-MNIST.
#
# One client per rank. Each round `--clients_per_round` clients are drawn
# (same draw on every rank, seeded by the round number); only those train and
# take part in the weighted average, after which the new global model is sent
# to everybody.
#
#   torchrun --nproc_per_node=8 05_fedavg_partial_participation.py --clients_per_round 4
import argparse
import csv
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset
from torchvision import datasets, transforms


def get_parser():
    parser = argparse.ArgumentParser("fedavg-fmnist")
    parser.add_argument("--root", type=str, default="data/")
    parser.add_argument("--out", type=str, default="results/fmnist_pp")
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--clients_per_round", type=int, default=4)
    parser.add_argument("--local_epochs", type=int, default=5)
    parser.add_argument("--batch_size", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--dirichlet_alpha", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=7)
    return parser


class LeNet5(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(1, 6, 5, padding=2)
        self.c3 = nn.Conv2d(6, 16, 5)
        self.f5 = nn.Linear(16 * 5 * 5, 120)
        self.f6 = nn.Linear(120, 84)
        self.out = nn.Linear(84, 10)

    def forward(self, x):
        x = F.avg_pool2d(torch.tanh(self.c1(x)), 2)
        x = F.avg_pool2d(torch.tanh(self.c3(x)), 2)
        x = x.flatten(1)
        x = torch.tanh(self.f5(x))
        x = torch.tanh(self.f6(x))
        return self.out(x)


def dirichlet_partition(targets, n, alpha, seed):
    rng = np.random.default_rng(seed)
    targets = np.asarray(targets)
    result = [[] for _ in range(n)]
    for cls in range(10):
        idx = np.flatnonzero(targets == cls)
        rng.shuffle(idx)
        p = rng.dirichlet([alpha] * n)
        counts = np.floor(p * len(idx)).astype(int)
        counts[-1] = len(idx) - counts[:-1].sum()
        start = 0
        for k in range(n):
            result[k].extend(idx[start:start + counts[k]].tolist())
            start += counts[k]
    return result


def train_local(model, loader, epochs, lr, device):
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    seen, loss_sum = 0, 0.0
    for _ in range(epochs):
        for data, target in loader:
            data, target = data.to(device), target.to(device)
            opt.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            opt.step()
            loss_sum += loss.item() * data.size(0)
            seen += data.size(0)
    return loss_sum / max(seen, 1)


@torch.no_grad()
def weighted_average(model, n_samples, device, group):
    w = torch.tensor([float(n_samples)], device=device)
    w_total = w.clone()
    dist.all_reduce(w_total, group=group)
    frac = (w / w_total).item()
    for p in model.parameters():
        p.data.mul_(frac)
        dist.all_reduce(p.data, group=group)


@torch.no_grad()
def test_accuracy(model, loader, device):
    model.eval()
    good = total = 0
    for data, target in loader:
        pred = model(data.to(device)).argmax(dim=1)
        good += (pred == target.to(device)).sum().item()
        total += target.size(0)
    return good / total


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    assert args.clients_per_round <= world_size
    torch.manual_seed(args.seed)

    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.2860,), (0.3530,))])
    if rank == 0:
        datasets.FashionMNIST(args.root, train=True, download=True)
        datasets.FashionMNIST(args.root, train=False, download=True)
    dist.barrier()
    train_ds = datasets.FashionMNIST(args.root, train=True, transform=tf)
    test_ds = datasets.FashionMNIST(args.root, train=False, transform=tf)

    shards = dirichlet_partition(train_ds.targets.numpy(), world_size, args.dirichlet_alpha, args.seed)
    my_shard = shards[rank]
    loader = DataLoader(Subset(train_ds, my_shard), batch_size=args.batch_size, shuffle=True,
                        num_workers=2, pin_memory=True)

    model = LeNet5().to(device)
    for p in model.parameters():
        dist.broadcast(p.data, src=0)

    writer = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        test_loader = DataLoader(test_ds, batch_size=1000)
        csv_file = open(os.path.join(args.out, "log.csv"), "w", newline="")
        writer = csv.writer(csv_file)
        writer.writerow(["round", "participants", "test_acc", "seconds"])

    for rnd in range(args.rounds):
        tic = time.time()
        round_rng = np.random.default_rng(args.seed + 1 + rnd)
        sampled = sorted(round_rng.choice(world_size, args.clients_per_round, replace=False).tolist())

        if rank in sampled:
            group = dist.new_group(ranks=sampled)
            train_local(model, loader, args.local_epochs, args.lr, device)
            weighted_average(model, len(my_shard), device, group)

        # the first sampled client now holds the aggregated model
        for p in model.parameters():
            dist.broadcast(p.data, src=sampled[0])

        if rank == 0:
            acc = test_accuracy(model, test_loader, device)
            writer.writerow([rnd, " ".join(map(str, sampled)), f"{acc:.4f}",
                             f"{time.time() - tic:.2f}"])
            csv_file.flush()
            print(f"[round {rnd}] clients {sampled} -> test acc {acc:.4f}")

    if rank == 0:
        torch.save(model.state_dict(), os.path.join(args.out, "global_final.pt"))
        csv_file.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
