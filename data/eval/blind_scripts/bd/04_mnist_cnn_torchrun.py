#!/usr/bin/env python
# -*- coding: utf-8 -*-
"""
Assignment 3 - Distributed training of a CNN on MNIST
Course: Parallel and Distributed Deep Learning

How to run (single node, 4 GPUs):
    torchrun --nproc_per_node=4 04_mnist_cnn_torchrun.py --epochs 5

The script prints the training loss every `--print-freq` iterations and the
test accuracy after every epoch. The model with the best test accuracy is
saved to `--out`.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def parse_args():
    parser = argparse.ArgumentParser(description="MNIST DDP (assignment 3)")
    parser.add_argument("--data-root", type=str, default="./data")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64,
                        help="mini-batch size per process")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--print-freq", type=int, default=100)
    parser.add_argument("--out", type=str, default="best_mnist.pt")
    parser.add_argument("--local_rank", type=int, default=0,
                        help="local rank of this process on the node")
    return parser.parse_args()


# ------------------------------------------------------------------ model ---
class SimpleCNN(nn.Module):
    """ Two conv layers + two fully connected layers (LeNet-like). """

    def __init__(self, num_classes=10):
        super(SimpleCNN, self).__init__()
        self.conv1 = nn.Conv2d(1, 16, kernel_size=5, padding=2)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=5, padding=2)
        self.fc1 = nn.Linear(32 * 7 * 7, 256)
        self.fc2 = nn.Linear(256, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)   # 16 x 14 x 14
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)   # 32 x 7 x 7
        x = x.view(x.size(0), -1)
        x = F.relu(self.fc1(x))
        return self.fc2(x)


# ------------------------------------------------------------------- data ---
def make_loaders(args, rank, world_size):
    transform = transforms.Compose([
        transforms.ToTensor(),
        transforms.Normalize((0.1307,), (0.3081,)),
    ])

    # Q3a: avoid that all processes download the data at the same time
    if rank == 0:
        datasets.MNIST(args.data_root, train=True, download=True)
        datasets.MNIST(args.data_root, train=False, download=True)
    dist.barrier()

    train_set = datasets.MNIST(args.data_root, train=True, transform=transform)
    test_set = datasets.MNIST(args.data_root, train=False, transform=transform)

    # Q3b: every process must see a different part of the data
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    test_sampler = DistributedSampler(test_set, num_replicas=world_size, rank=rank, shuffle=False)

    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=2, pin_memory=True)
    test_loader = DataLoader(test_set, batch_size=500, sampler=test_sampler,
                             num_workers=2, pin_memory=True)
    return train_loader, test_loader, train_sampler


# --------------------------------------------------------------- training ---
def train(model, loader, optimizer, epoch, device, args, rank):
    model.train()
    tic = time.time()
    for it, (x, y) in enumerate(loader):
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if rank == 0 and it % args.print_freq == 0:
            print("epoch %d  iter %4d/%d  loss %.4f  (%.1f s)"
                  % (epoch, it, len(loader), loss.item(), time.time() - tic))


def test(model, loader, device):
    # Q3c: the test set is split as well, so sum the counts of all processes
    model.eval()
    correct = torch.zeros(1, device=device)
    total = torch.zeros(1, device=device)
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            pred = model(x).argmax(dim=1)
            correct += (pred == y).sum()
            total += y.numel()
    dist.all_reduce(correct, op=dist.ReduceOp.SUM)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return (correct / total).item()


def main():
    args = parse_args()

    torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()

    if rank == 0:
        print("Training with %d processes" % world_size)
        print(args)

    train_loader, test_loader, train_sampler = make_loaders(args, rank, world_size)

    model = SimpleCNN().to(device)
    model = DistributedDataParallel(model, device_ids=[device.index])

    # Q3d: the global batch is world_size * batch_size, so scale the lr
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * world_size,
                                momentum=args.momentum)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        train(model, train_loader, optimizer, epoch, device, args, rank)
        acc = test(model, test_loader, device)

        if rank == 0:
            print("==> epoch %d test accuracy: %.2f %%" % (epoch, 100 * acc))
            if acc > best:
                best = acc
                torch.save(model.module.state_dict(), args.out)
                print("    saved best model to %s" % args.out)

    if rank == 0:
        print("best accuracy: %.2f %%" % (100 * best))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
