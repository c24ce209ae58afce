#!/usr/bin/env python
# WideResNet-28-10 on CIFAR-100, data-parallel over two nodes.
#
# Job script:
#   #SBATCH -N 2
#   #SBATCH --ntasks-per-node=4
#   #SBATCH --gres=gpu:4
#   #SBATCH -c 8
#   export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1)
#   export MASTER_PORT=$((20000 + RANDOM % 10000))
#   srun --export=ALL python wrn_cifar.py --data $PROJECT/data/cifar100 --out $PROJECT/runs/wrn
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
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride, drop):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.drop = drop
        self.short = None if (cin == cout and stride == 1) else nn.Conv2d(cin, cout, 1, stride, bias=False)

    def forward(self, x):
        o = F.relu(self.bn1(x))
        y = self.conv1(o)
        y = F.dropout(F.relu(self.bn2(y)), self.drop, self.training)
        y = self.conv2(y)
        return y + (x if self.short is None else self.short(o))


class WideResNet(nn.Module):
    def __init__(self, depth=28, k=10, num_classes=100, drop=0.3):
        super().__init__()
        n = (depth - 4) // 6
        widths = [16, 16 * k, 32 * k, 64 * k]
        self.conv = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)
        layers, cin = [], widths[0]
        for i, w in enumerate(widths[1:]):
            for j in range(n):
                layers.append(BasicBlock(cin, w, (1 if i == 0 else 2) if j == 0 else 1, drop))
                cin = w
        self.blocks = nn.Sequential(*layers)
        self.bn = nn.BatchNorm2d(cin)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.blocks(self.conv(x))
        x = F.adaptive_avg_pool2d(F.relu(self.bn(x)), 1).flatten(1)
        return self.fc(x)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16, help="per process; 8 procs -> 128")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--wd", type=float, default=5e-4)
    return p.parse_args()


def main():
    args = get_args()
    rank = int(os.environ["SLURM_PROCID"])
    world = int(os.environ["SLURM_NTASKS"])
    local = int(os.environ["SLURM_LOCALID"])
    torch.cuda.set_device(local)
    dist.init_process_group(backend="nccl", rank=rank, world_size=world)

    mean, std = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
    train_tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(),
                          T.ToTensor(), T.Normalize(mean, std)])
    test_tf = T.Compose([T.ToTensor(), T.Normalize(mean, std)])
    train_set = torchvision.datasets.CIFAR100(args.data, train=True, download=False, transform=train_tf)
    test_set = torchvision.datasets.CIFAR100(args.data, train=False, download=False, transform=test_tf)

    train_sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True)
    test_sampler = DistributedSampler(test_set, num_replicas=world, rank=rank, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=6, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=250, sampler=test_sampler, num_workers=4)

    net = WideResNet().cuda()
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    net = DDP(net, device_ids=[local])

    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9,
                                weight_decay=args.wd, nesterov=True)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[60, 120, 160], gamma=0.2)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    resume = os.path.join(args.out, "checkpoint.pth")
    start_epoch, best = 0, 0.0
    if os.path.exists(resume):
        ck = torch.load(resume, map_location="cpu")
        net.module.load_state_dict(ck["net"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]

    log = []
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        net.train()
        tic = time.time()
        tr_loss = torch.zeros(2, device="cuda")
        for x, y in train_loader:
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            out = net(x)
            loss = F.cross_entropy(out, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            tr_loss[0] += loss.detach() * y.size(0)
            tr_loss[1] += y.size(0)
        scheduler.step()
        dist.all_reduce(tr_loss)

        net.eval()
        correct, total = 0, 0
        with torch.no_grad():
            for x, y in test_loader:
                x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
                pred = net(x).argmax(1)
                correct += (pred == y).sum().item()
                total += y.size(0)
        test_acc = 100.0 * correct / total

        if rank == 0:
            train_loss = (tr_loss[0] / tr_loss[1]).item()
            print(f"epoch {epoch:3d} | loss {train_loss:.4f} | test acc {test_acc:.2f} | "
                  f"{time.time() - tic:.1f}s", flush=True)
            log.append({"epoch": epoch, "train_loss": train_loss, "test_acc": test_acc})
            with open(os.path.join(args.out, "log.jsonl"), "a") as f:
                f.write(json.dumps(log[-1]) + "\n")
            if test_acc > best:
                best = test_acc
                torch.save(net.module.state_dict(), os.path.join(args.out, "best.pth"))
            torch.save({"net": net.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch, "best": best}, resume)
        dist.barrier()

    if rank == 0:
        print(f"best test accuracy {best:.2f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
