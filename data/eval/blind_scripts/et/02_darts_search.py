"""DARTS (first-order) architecture search on CIFAR-10, data parallel.

The CIFAR-10 training set is split in two halves: one half trains the
network weights, the other half trains the architecture parameters.

    torchrun --nproc_per_node=4 02_darts_search.py --data ./data --save search-exp
"""
import argparse
import json
import logging
import os
import random
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.datasets as dset
import torchvision.transforms as transforms
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

PRIMITIVES = ["none", "max_pool_3x3", "avg_pool_3x3", "skip_connect",
              "sep_conv_3x3", "sep_conv_5x5", "dil_conv_3x3", "dil_conv_5x5"]

CIFAR_MEAN = [0.49139968, 0.48215827, 0.44653124]
CIFAR_STD = [0.24703233, 0.24348505, 0.26158768]


def get_args():
    parser = argparse.ArgumentParser("darts-search")
    parser.add_argument("--data", type=str, default="./data")
    parser.add_argument("--batch_size", type=int, default=64, help="per GPU")
    parser.add_argument("--learning_rate", type=float, default=0.025)
    parser.add_argument("--learning_rate_min", type=float, default=0.001)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight_decay", type=float, default=3e-4)
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--init_channels", type=int, default=16)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--train_portion", type=float, default=0.5)
    parser.add_argument("--grad_clip", type=float, default=5)
    parser.add_argument("--arch_learning_rate", type=float, default=3e-4)
    parser.add_argument("--arch_weight_decay", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=2)
    parser.add_argument("--save", type=str, default="search-exp")
    return parser.parse_args()


def sep_conv(C, k, p):
    return nn.Sequential(
        nn.ReLU(inplace=False), nn.Conv2d(C, C, k, 1, p, groups=C, bias=False),
        nn.Conv2d(C, C, 1, bias=False), nn.BatchNorm2d(C, affine=False),
        nn.ReLU(inplace=False), nn.Conv2d(C, C, k, 1, p, groups=C, bias=False),
        nn.Conv2d(C, C, 1, bias=False), nn.BatchNorm2d(C, affine=False))


def dil_conv(C, k, p, d):
    return nn.Sequential(
        nn.ReLU(inplace=False), nn.Conv2d(C, C, k, 1, p, dilation=d, groups=C, bias=False),
        nn.Conv2d(C, C, 1, bias=False), nn.BatchNorm2d(C, affine=False))


class Zero(nn.Module):
    def forward(self, x):
        return x.mul(0.0)


def make_op(name, C):
    if name == "none":
        return Zero()
    if name == "max_pool_3x3":
        return nn.Sequential(nn.MaxPool2d(3, 1, 1), nn.BatchNorm2d(C, affine=False))
    if name == "avg_pool_3x3":
        return nn.Sequential(nn.AvgPool2d(3, 1, 1, count_include_pad=False),
                             nn.BatchNorm2d(C, affine=False))
    if name == "skip_connect":
        return nn.Identity()
    if name == "sep_conv_3x3":
        return sep_conv(C, 3, 1)
    if name == "sep_conv_5x5":
        return sep_conv(C, 5, 2)
    if name == "dil_conv_3x3":
        return dil_conv(C, 3, 2, 2)
    return dil_conv(C, 5, 4, 2)


class MixedOp(nn.Module):
    def __init__(self, C):
        super().__init__()
        self._ops = nn.ModuleList([make_op(p, C) for p in PRIMITIVES])

    def forward(self, x, weights):
        return sum(w * op(x) for w, op in zip(weights, self._ops))


class Cell(nn.Module):
    def __init__(self, C_prev, C, steps=4):
        super().__init__()
        self.pre = nn.Sequential(nn.ReLU(inplace=False), nn.Conv2d(C_prev, C, 1, bias=False),
                                 nn.BatchNorm2d(C, affine=False))
        self.steps = steps
        self.ops = nn.ModuleList()
        for i in range(steps):
            for _ in range(1 + i):
                self.ops.append(MixedOp(C))

    def forward(self, s, weights):
        states = [self.pre(s)]
        offset = 0
        for _ in range(self.steps):
            h = sum(self.ops[offset + j](st, weights[offset + j]) for j, st in enumerate(states))
            offset += len(states)
            states.append(h)
        return torch.cat(states[-self.steps:], dim=1)


class Network(nn.Module):
    def __init__(self, C, num_classes, layers, steps=4):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 3 * C, 3, padding=1, bias=False), nn.BatchNorm2d(3 * C))
        cells, C_prev, C_curr = [], 3 * C, C
        self.reduce_at = {layers // 3, 2 * layers // 3}
        self.downs = nn.ModuleDict()
        for i in range(layers):
            if i in self.reduce_at:
                C_curr *= 2
                self.downs[str(i)] = nn.Sequential(nn.AvgPool2d(2), nn.Conv2d(C_prev, C_prev, 1, bias=False),
                                                   nn.BatchNorm2d(C_prev))
            cells.append(Cell(C_prev, C_curr, steps))
            C_prev = steps * C_curr
        self.cells = nn.ModuleList(cells)
        self.classifier = nn.Linear(C_prev, num_classes)
        k = sum(1 + i for i in range(steps))
        self.alphas = nn.Parameter(1e-3 * torch.randn(k, len(PRIMITIVES)))

    def weight_parameters(self):
        return [p for n, p in self.named_parameters() if n != "alphas"]

    def arch_parameters(self):
        return [self.alphas]

    def forward(self, x):
        s = self.stem(x)
        w = F.softmax(self.alphas, dim=-1)
        for i, cell in enumerate(self.cells):
            if str(i) in self.downs:
                s = self.downs[str(i)](s)
            s = cell(s, w)
        return self.classifier(F.adaptive_avg_pool2d(s, 1).flatten(1))

    def genotype(self):
        w = F.softmax(self.alphas, dim=-1).detach().cpu().numpy()
        return [PRIMITIVES[int(np.argmax(row[1:])) + 1] for row in w]


def accuracy(logits, target):
    return (logits.argmax(1) == target).float().sum()


def main():
    args = get_args()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    device = torch.device("cuda", local_rank)

    # different seed per rank so the augmentation differs between GPUs
    np.random.seed(args.seed + rank)
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.benchmark = True

    if rank == 0:
        os.makedirs(args.save, exist_ok=True)
    logging.basicConfig(stream=sys.stdout, level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(message)s")

    train_transform = transforms.Compose([
        transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), transforms.Normalize(CIFAR_MEAN, CIFAR_STD)])
    train_data = dset.CIFAR10(root=args.data, train=True, download=False, transform=train_transform)

    num_train = len(train_data)
    indices = np.arange(num_train)
    np.random.shuffle(indices)
    split = int(np.floor(args.train_portion * num_train))
    train_subset = Subset(train_data, indices[:split].tolist())
    valid_subset = Subset(train_data, indices[split:num_train].tolist())

    train_sampler = DistributedSampler(train_subset, shuffle=True)
    valid_sampler = DistributedSampler(valid_subset, shuffle=True)
    train_queue = DataLoader(train_subset, batch_size=args.batch_size, sampler=train_sampler,
                             pin_memory=True, num_workers=4, drop_last=True)
    valid_queue = DataLoader(valid_subset, batch_size=args.batch_size, sampler=valid_sampler,
                             pin_memory=True, num_workers=4, drop_last=True)

    model = Network(args.init_channels, 10, args.layers).to(device)
    # DDP broadcasts rank 0's weights and alphas at construction
    model = DDP(model, device_ids=[local_rank])
    net = model.module

    w_optimizer = torch.optim.SGD(net.weight_parameters(), args.learning_rate * world_size,
                                  momentum=args.momentum, weight_decay=args.weight_decay)
    a_optimizer = torch.optim.Adam(net.arch_parameters(), lr=args.arch_learning_rate,
                                   betas=(0.5, 0.999), weight_decay=args.arch_weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
        w_optimizer, float(args.epochs), eta_min=args.learning_rate_min)
    criterion = nn.CrossEntropyLoss().to(device)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        valid_sampler.set_epoch(epoch)
        model.train()
        stats = torch.zeros(3, device=device)
        for step, ((x, y), (x_val, y_val)) in enumerate(zip(train_queue, valid_queue)):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x_val, y_val = x_val.to(device, non_blocking=True), y_val.to(device, non_blocking=True)

            # architecture step on the held-out half
            a_optimizer.zero_grad()
            loss_a = criterion(model(x_val), y_val)
            loss_a.backward()
            a_optimizer.step()

            # weight step on the training half
            w_optimizer.zero_grad()
            a_optimizer.zero_grad()
            logits = model(x)
            loss = criterion(logits, y)
            loss.backward()
            nn.utils.clip_grad_norm_(net.weight_parameters(), args.grad_clip)
            w_optimizer.step()

            stats[0] += loss.detach() * y.size(0)
            stats[1] += accuracy(logits.detach(), y)
            stats[2] += y.size(0)
            if step % 50 == 0:
                logging.info("epoch %d step %03d loss %.4f", epoch, step, loss.item())
        scheduler.step()

        dist.all_reduce(stats)
        logging.info("epoch %d train loss %.4f acc %.2f lr %.5f", epoch,
                     (stats[0] / stats[2]).item(), (100 * stats[1] / stats[2]).item(),
                     scheduler.get_last_lr()[0])
        logging.info("genotype = %s", net.genotype())

        if rank == 0:
            torch.save({"epoch": epoch, "state_dict": net.state_dict(),
                        "w_optimizer": w_optimizer.state_dict(),
                        "a_optimizer": a_optimizer.state_dict()},
                       os.path.join(args.save, "search_ckpt.pt"))
            with open(os.path.join(args.save, "genotype.json"), "w") as f:
                json.dump({"epoch": epoch, "genotype": net.genotype()}, f)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
