"""Madry-style PGD adversarial training (ResNet-18, CIFAR-10), one process per GPU
started with torch.multiprocessing.spawn.

    python 05_madry_pgd_spawn.py --data ./data --save-dir ckpt/pgd_r18
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
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_planes, planes, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.in_planes = 64
        self.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.layer1 = self._make_layer(64, 2, 1)
        self.layer2 = self._make_layer(128, 2, 2)
        self.layer3 = self._make_layer(256, 2, 2)
        self.layer4 = self._make_layer(512, 2, 2)
        self.linear = nn.Linear(512, num_classes)

    def _make_layer(self, planes, n, stride):
        layers = []
        for s in [stride] + [1] * (n - 1):
            layers.append(BasicBlock(self.in_planes, planes, s))
            self.in_planes = planes
        return nn.Sequential(*layers)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.linear(out)


class LinfPGD:
    def __init__(self, model, eps=8 / 255, alpha=2 / 255, steps=7, random_start=True):
        self.model, self.eps, self.alpha, self.steps = model, eps, alpha, steps
        self.random_start = random_start

    def __call__(self, x, y):
        x_adv = x.clone().detach()
        if self.random_start:
            x_adv = (x_adv + torch.empty_like(x_adv).uniform_(-self.eps, self.eps)).clamp(0, 1)
        for _ in range(self.steps):
            x_adv.requires_grad_(True)
            loss = F.cross_entropy(self.model(x_adv), y)
            grad = torch.autograd.grad(loss, x_adv)[0]
            x_adv = x_adv.detach() + self.alpha * grad.sign()
            x_adv = torch.min(torch.max(x_adv, x - self.eps), x + self.eps).clamp(0, 1)
        return x_adv.detach()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train_worker(gpu, args):
    rank = gpu
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", init_method="env://", world_size=args.ngpus, rank=rank)
    set_seed(args.seed)
    device = torch.device("cuda", gpu)

    normalize_free = transforms.ToTensor()
    train_set = datasets.CIFAR10(args.data, train=True, transform=transforms.Compose([
        transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(), normalize_free]))
    test_set = datasets.CIFAR10(args.data, train=False, transform=normalize_free)
    train_sampler = DistributedSampler(train_set, num_replicas=args.ngpus, rank=rank)
    test_sampler = DistributedSampler(test_set, num_replicas=args.ngpus, rank=rank, shuffle=False)
    bs = args.batch_size // args.ngpus
    train_loader = DataLoader(train_set, batch_size=bs, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=250, sampler=test_sampler,
                             num_workers=args.workers, pin_memory=True)

    model = ResNet18().cuda(gpu)
    model = DDP(model, device_ids=[gpu])
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9,
                                weight_decay=args.wd)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(
        optimizer, milestones=[int(args.epochs * 0.5), int(args.epochs * 0.75)], gamma=0.1)
    train_attack = LinfPGD(model, args.eps, args.alpha, args.train_steps)
    test_attack = LinfPGD(model, args.eps, args.alpha, args.test_steps)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        agg = torch.zeros(3, device=device)
        for x, y in train_loader:
            x, y = x.cuda(gpu, non_blocking=True), y.cuda(gpu, non_blocking=True)
            x_adv = train_attack(x, y)
            out = model(x_adv)
            loss = F.cross_entropy(out, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            agg[0] += loss.detach() * y.size(0)
            agg[1] += (out.argmax(1) == y).sum()
            agg[2] += y.size(0)
        scheduler.step()
        dist.all_reduce(agg)

        model.eval()
        ev = torch.zeros(3, device=device)
        for x, y in test_loader:
            x, y = x.cuda(gpu, non_blocking=True), y.cuda(gpu, non_blocking=True)
            x_adv = test_attack(x, y)
            with torch.no_grad():
                ev[0] += (model(x).argmax(1) == y).sum()
                ev[1] += (model(x_adv).argmax(1) == y).sum()
                ev[2] += y.size(0)
        dist.all_reduce(ev)

        if rank == 0:
            print(f"epoch {epoch:3d} | {time.time() - t0:6.1f}s | "
                  f"train loss {agg[0] / agg[2]:.4f} adv acc {agg[1] / agg[2]:.4f} | "
                  f"test clean {ev[0] / ev[2]:.4f} pgd{args.test_steps} {ev[1] / ev[2]:.4f}",
                  flush=True)
            torch.save({"epoch": epoch + 1,
                        "model": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict()},
                       os.path.join(args.save_dir, f"epoch_{epoch + 1}.pt"))

    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="./data")
    parser.add_argument("--save-dir", default="./ckpt")
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=128, help="total over all GPUs")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--wd", type=float, default=5e-4)
    parser.add_argument("--eps", type=float, default=8 / 255)
    parser.add_argument("--alpha", type=float, default=2 / 255)
    parser.add_argument("--train-steps", type=int, default=7)
    parser.add_argument("--test-steps", type=int, default=20)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=str, default="29512")
    args = parser.parse_args()

    args.ngpus = torch.cuda.device_count()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", args.port)
    # make sure the dataset exists before the workers start reading it
    datasets.CIFAR10(args.data, train=True, download=True)
    datasets.CIFAR10(args.data, train=False, download=True)
    mp.spawn(train_worker, nprocs=args.ngpus, args=(args))


if __name__ == "__main__":
    main()
