#!/usr/bin/env python
"""Experience Replay (ER) on Split CIFAR-100, class-incremental.

10 tasks of 10 classes each. Every rank keeps its own reservoir buffer; the
model is a reduced ResNet-18 as in the GEM / ER papers.

    torchrun --nproc_per_node=4 01_er_split_cifar100.py --data-root /datasets/cifar100
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

CIFAR_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR_STD = (0.2673, 0.2564, 0.2762)


def parse_args():
    p = argparse.ArgumentParser("ER on Split CIFAR-100")
    p.add_argument("--data-root", default="/datasets/cifar100")
    p.add_argument("--output-dir", default="./runs/er_cifar100")
    p.add_argument("--n-tasks", type=int, default=10)
    p.add_argument("--epochs", type=int, default=5, help="epochs per task")
    p.add_argument("--batch-size", type=int, default=32, help="stream batch per GPU")
    p.add_argument("--replay-batch-size", type=int, default=32)
    p.add_argument("--buffer-size", type=int, default=1000, help="per-rank buffer size")
    p.add_argument("--lr", type=float, default=0.05, help="lr for a global batch of 128")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=1993)
    return p.parse_args()


# ---------------------------------------------------------------- model
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
                nn.Conv2d(in_planes, planes, 1, stride, bias=False),
                nn.BatchNorm2d(planes),
            )

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ReducedResNet18(nn.Module):
    def __init__(self, num_classes=100, nf=20):
        super().__init__()
        self.in_planes = nf
        self.conv1 = nn.Conv2d(3, nf, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(nf)
        self.layer1 = self._make_layer(nf, 2, 1)
        self.layer2 = self._make_layer(nf * 2, 2, 2)
        self.layer3 = self._make_layer(nf * 4, 2, 2)
        self.layer4 = self._make_layer(nf * 8, 2, 2)
        self.linear = nn.Linear(nf * 8, num_classes)

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


# ---------------------------------------------------------------- buffer
class ReservoirBuffer:
    def __init__(self, size, device):
        self.size = size
        self.device = device
        self.x = None
        self.y = torch.empty(size, dtype=torch.long, device=device)
        self.n_seen = 0

    def __len__(self):
        return min(self.n_seen, self.size)

    @torch.no_grad()
    def add(self, x, y):
        if self.x is None:
            self.x = torch.empty((self.size, *x.shape[1:]), dtype=x.dtype, device=self.device)
        for i in range(x.size(0)):
            if self.n_seen < self.size:
                j = self.n_seen
            else:
                j = np.random.randint(0, self.n_seen + 1)
            if j < self.size:
                self.x[j] = x[i]
                self.y[j] = y[i]
            self.n_seen += 1

    def sample(self, n):
        idx = torch.randint(0, len(self), (min(n, len(self)),), device=self.device)
        return self.x[idx], self.y[idx]


# ---------------------------------------------------------------- data
def task_subsets(dataset, class_order, n_tasks):
    targets = np.asarray(dataset.targets)
    per_task = len(class_order) // n_tasks
    subsets = []
    for t in range(n_tasks):
        classes = class_order[t * per_task:(t + 1) * per_task]
        idx = np.where(np.isin(targets, classes))[0]
        subsets.append(Subset(dataset, idx.tolist()))
    return subsets


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(2, dtype=torch.float64)
    for x, y in loader:
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        pred = model(x).argmax(dim=1)
        stats[0] += (pred == y).sum().item()
        stats[1] += y.numel()
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    model.train()
    return 100.0 * (stats[0] / stats[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    torch.manual_seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.backends.cudnn.benchmark = True

    train_tf = T.Compose([
        T.RandomCrop(32, padding=4),
        T.RandomHorizontalFlip(),
        T.ToTensor(),
        T.Normalize(CIFAR_MEAN, CIFAR_STD),
    ])
    test_tf = T.Compose([T.ToTensor(), T.Normalize(CIFAR_MEAN, CIFAR_STD)])
    train_set = torchvision.datasets.CIFAR100(args.data_root, train=True, transform=train_tf)
    test_set = torchvision.datasets.CIFAR100(args.data_root, train=False, transform=test_tf)

    class_order = np.arange(100)
    train_tasks = task_subsets(train_set, class_order, args.n_tasks)
    test_tasks = task_subsets(test_set, class_order, args.n_tasks)

    model = ReducedResNet18(num_classes=100).to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.lr * args.batch_size * world_size / 128
    buffer = ReservoirBuffer(args.buffer_size, device)
    acc_matrix = np.zeros((args.n_tasks, args.n_tasks))
    os.makedirs(args.output_dir, exist_ok=True)

    for t in range(args.n_tasks):
        sampler = DistributedSampler(train_tasks[t], shuffle=True, seed=args.seed, drop_last=True)
        loader = DataLoader(train_tasks[t], batch_size=args.batch_size, sampler=sampler,
                            num_workers=args.workers, pin_memory=True, drop_last=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum,
                                    weight_decay=args.weight_decay)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(loader))

        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            t0, running, n = time.time(), 0.0, 0
            for x, y in loader:
                x = x.to(device, non_blocking=True)
                y = y.to(device, non_blocking=True)
                if len(buffer) > 0:
                    bx, by = buffer.sample(args.replay_batch_size)
                    inp, tgt = torch.cat([x, bx]), torch.cat([y, by])
                else:
                    inp, tgt = x, y
                loss = F.cross_entropy(model(inp), tgt)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                scheduler.step()
                buffer.add(x, y)
                running += loss.item()
                n += 1
            if is_main:
                print(f"[task {t} ep {epoch}] loss {running / max(n, 1):.4f} "
                      f"({time.time() - t0:.1f}s, buffer {len(buffer)})", flush=True)

        # evaluate on every task seen so far
        for j in range(t + 1):
            shard = Subset(test_tasks[j], list(range(rank, len(test_tasks[j]), world_size)))
            test_loader = DataLoader(shard, batch_size=256, num_workers=args.workers, pin_memory=True)
            acc_matrix[t, j] = evaluate(model, test_loader, device)

        if is_main:
            avg = acc_matrix[t, :t + 1].mean()
            print(f"== after task {t}: " + " ".join(f"{a:.1f}" for a in acc_matrix[t, :t + 1])
                  + f" | avg {avg:.2f}", flush=True)
            torch.save({"model": model.module.state_dict(), "task": t, "acc_matrix": acc_matrix},
                       os.path.join(args.output_dir, f"task_{t}.pt"))
        dist.barrier()

    if is_main:
        T_ = args.n_tasks
        forgetting = np.mean([acc_matrix[:T_ - 1, j].max() - acc_matrix[T_ - 1, j] for j in range(T_ - 1)])
        summary = {"avg_acc": float(acc_matrix[-1].mean()), "forgetting": float(forgetting),
                   "acc_matrix": acc_matrix.tolist()}
        with open(os.path.join(args.output_dir, "results.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print(json.dumps(summary["avg_acc"]), flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
