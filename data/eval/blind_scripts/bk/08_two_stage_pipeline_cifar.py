#!/usr/bin/env python
# Model-parallel WideResNet split over two GPUs (rank 0: stem + group 1-2,
# rank 1: group 3 + head). Activations and their gradients are exchanged with
# send/recv; rank 0 also forwards the labels. Single micro-batch, no overlap -
# this is the baseline for the pipelined version.
#
#   torchrun --nproc_per_node=2 08_two_stage_pipeline_cifar.py --depth 28 --widen 10
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchvision import datasets, transforms


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride, drop=0.0):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.drop = drop
        self.short = None if cin == cout and stride == 1 else nn.Conv2d(cin, cout, 1, stride, bias=False)

    def forward(self, x):
        o = F.relu(self.bn1(x))
        y = self.conv1(o)
        y = F.relu(self.bn2(y))
        if self.drop > 0:
            y = F.dropout(y, p=self.drop, training=self.training)
        y = self.conv2(y)
        return y + (x if self.short is None else self.short(o))


def group(cin, cout, n, stride, drop):
    return nn.Sequential(*[BasicBlock(cin if i == 0 else cout, cout, stride if i == 0 else 1, drop)
                           for i in range(n)])


def build_stage(stage, depth, widen, drop, num_classes=10):
    n = (depth - 4) // 6
    w = [16, 16 * widen, 32 * widen, 64 * widen]
    if stage == 0:
        return nn.Sequential(nn.Conv2d(3, w[0], 3, 1, 1, bias=False),
                             group(w[0], w[1], n, 1, drop),
                             group(w[1], w[2], n, 2, drop))
    return nn.Sequential(group(w[2], w[3], n, 2, drop),
                         nn.BatchNorm2d(w[3]), nn.ReLU(inplace=True),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(w[3], num_classes))


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="./data")
    p.add_argument("--depth", type=int, default=28)
    p.add_argument("--widen", type=int, default=10)
    p.add_argument("--dropout", type=float, default=0.3)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--ckpt", default="wrn_pipe")
    return p.parse_args()


def loaders(args, rank):
    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    tr = transforms.Compose([transforms.RandomCrop(32, 4), transforms.RandomHorizontalFlip(),
                             transforms.ToTensor(), transforms.Normalize(mean, std)])
    te = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])
    train = datasets.CIFAR10(args.data, train=True, transform=tr, download=True)
    test = datasets.CIFAR10(args.data, train=False, transform=te, download=True)
    return (DataLoader(train, batch_size=args.batch_size, shuffle=True, num_workers=8, pin_memory=True),
            DataLoader(test, batch_size=args.batch_size, shuffle=False, num_workers=4, pin_memory=True))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, "this script runs exactly two stages"
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    stage = build_stage(rank, args.depth, args.widen, args.dropout).to(device)
    opt = torch.optim.SGD(stage.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [60, 120, 160], gamma=0.2)

    # shape of the tensor crossing the cut (group 2 output: 32*widen x 16 x 16)
    act_shape = (args.batch_size, 32 * args.widen, 16, 16)
    if rank == 0:
        train_dl, test_dl = loaders(args, rank)
        n_train, n_test = torch.tensor([len(train_dl)], device=device), torch.tensor([len(test_dl)], device=device)
    else:
        n_train, n_test = torch.zeros(1, dtype=torch.long, device=device), torch.zeros(1, dtype=torch.long, device=device)
    dist.broadcast(n_train, src=0)
    dist.broadcast(n_test, src=0)
    n_train, n_test = int(n_train.item()), int(n_test.item())

    os.makedirs(args.ckpt, exist_ok=True)
    for epoch in range(args.epochs):
        stage.train()
        t0 = time.time()
        it = iter(train_dl) if rank == 0 else None
        loss_sum = 0.0
        for step in range(n_train):
            if rank == 0:
                x, y = next(it)
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                h = stage(x)
                dist.send(h.detach(), dst=1)
                dist.send(y, dst=1)
                g = torch.empty_like(h)
                dist.recv(g, src=1)
                opt.zero_grad(set_to_none=True)
                h.backward(g)
                opt.step()
            else:
                h = torch.empty(act_shape, device=device)
                y = torch.empty(args.batch_size, dtype=torch.long, device=device)
                dist.recv(h, src=0)
                dist.recv(y, src=0)
                h.requires_grad_(True)
                loss = F.cross_entropy(stage(h), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                dist.send(h.grad, dst=0)
                opt.step()
                loss_sum += loss.item()
                if step % 100 == 0:
                    print(f"epoch {epoch} step {step}/{n_train} loss {loss.item():.4f}", flush=True)
        sched.step()

        stage.eval()
        correct = total = 0
        with torch.no_grad():
            it = iter(test_dl) if rank == 0 else None
            for _ in range(n_test):
                if rank == 0:
                    x, y = next(it)
                    h = stage(x.to(device))
                    dist.send(h, dst=1)
                    dist.send(y.to(device), dst=1)
                else:
                    h = torch.empty(act_shape, device=device)
                    y = torch.empty(args.batch_size, dtype=torch.long, device=device)
                    dist.recv(h, src=0)
                    dist.recv(y, src=0)
                    correct += (stage(h).argmax(1) == y).sum().item()
                    total += y.numel()
        if rank == 1:
            print(f"epoch {epoch} train_loss {loss_sum / n_train:.4f} test_acc {correct / total:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)

        # each stage saves its own half
        torch.save({"epoch": epoch, "stage": rank, "model": stage.state_dict(), "opt": opt.state_dict(),
                    "sched": sched.state_dict()}, os.path.join(args.ckpt, f"stage{rank}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
