"""
DenseNet-BC (k=12, depth 100) on CIFAR-100, one process per GPU via mp.spawn.
Keeps the checkpoint with the best validation accuracy.

    python 11_cifar100_densenet.py --world-size 4 --epochs 300
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
import torchvision
import torchvision.transforms as transforms


class Bottleneck(nn.Module):
    def __init__(self, in_planes, growth):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_planes)
        self.conv1 = nn.Conv2d(in_planes, 4 * growth, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(4 * growth)
        self.conv2 = nn.Conv2d(4 * growth, growth, 3, padding=1, bias=False)

    def forward(self, x):
        out = self.conv1(F.relu(self.bn1(x)))
        out = self.conv2(F.relu(self.bn2(out)))
        return torch.cat([out, x], 1)


class Transition(nn.Module):
    def __init__(self, in_planes, out_planes):
        super().__init__()
        self.bn = nn.BatchNorm2d(in_planes)
        self.conv = nn.Conv2d(in_planes, out_planes, 1, bias=False)

    def forward(self, x):
        return F.avg_pool2d(self.conv(F.relu(self.bn(x))), 2)


class DenseNet(nn.Module):
    def __init__(self, depth=100, growth=12, reduction=0.5, num_classes=100):
        super().__init__()
        n = (depth - 4) // 6
        planes = 2 * growth
        self.conv1 = nn.Conv2d(3, planes, 3, padding=1, bias=False)
        stages = []
        for i in range(3):
            block = []
            for _ in range(n):
                block.append(Bottleneck(planes, growth))
                planes += growth
            stages.append(nn.Sequential(*block))
            if i < 2:
                out_planes = int(math.floor(planes * reduction))
                stages.append(Transition(planes, out_planes))
                planes = out_planes
        self.features = nn.Sequential(*stages)
        self.bn = nn.BatchNorm2d(planes)
        self.linear = nn.Linear(planes, num_classes)

    def forward(self, x):
        out = self.features(self.conv1(x))
        out = F.adaptive_avg_pool2d(F.relu(self.bn(out)), 1).flatten(1)
        return self.linear(out)


def get_loaders(args, rank, world_size):
    mean, std = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
    train_tf = transforms.Compose([
        transforms.RandomCrop(32, padding=4),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    test_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])
    trainset = torchvision.datasets.CIFAR100(args.data, train=True, transform=train_tf)
    testset = torchvision.datasets.CIFAR100(args.data, train=False, transform=test_tf)
    train_sampler = DistributedSampler(trainset, num_replicas=world_size, rank=rank)
    test_sampler = DistributedSampler(testset, num_replicas=world_size, rank=rank, shuffle=False)
    trainloader = DataLoader(trainset, batch_size=args.batch_size, sampler=train_sampler,
                             num_workers=4, pin_memory=True, drop_last=True)
    testloader = DataLoader(testset, batch_size=250, sampler=test_sampler,
                            num_workers=4, pin_memory=True)
    return trainloader, testloader, train_sampler


def train_one_epoch(model, loader, optimizer, scheduler, device):
    model.train()
    total_loss, n = 0.0, 0
    for inputs, targets in loader:
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        scheduler.step()
        total_loss += loss.item()
        n += 1
    return total_loss / n


def test(model, loader, device):
    model.eval()
    correct, total, test_loss = 0, 0, 0.0
    with torch.no_grad():
        for inputs, targets in loader:
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            outputs = model(inputs)
            test_loss += F.cross_entropy(outputs, targets, reduction="sum").item()
            correct += outputs.argmax(1).eq(targets).sum().item()
            total += targets.size(0)
    return test_loss / total, 100.0 * correct / total


def worker(rank, world_size, args):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(args.port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    device = torch.device(f"cuda:{rank}")
    torch.backends.cudnn.benchmark = True

    trainloader, testloader, train_sampler = get_loaders(args, rank, world_size)

    model = DenseNet(depth=100, growth=12, num_classes=100).to(device)
    model = DDP(model, device_ids=[rank])

    lr = args.lr * (args.batch_size * world_size) / 64
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9,
                                weight_decay=1e-4, nesterov=True)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, epochs=args.epochs,
                                                    steps_per_epoch=len(trainloader), pct_start=0.15)

    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        train_loss = train_one_epoch(model, trainloader, optimizer, scheduler, device)
        test_loss, test_acc = test(model, testloader, device)

        if rank == 0:
            print(f"Epoch {epoch + 1:3d}/{args.epochs} | train loss {train_loss:.3f} | "
                  f"test loss {test_loss:.3f} | test acc {test_acc:.2f}% | {time.time() - t0:.0f}s")
            if test_acc > best_acc:
                best_acc = test_acc
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "acc": test_acc},
                           os.path.join(args.ckpt_dir, "densenet_bc100_best.pth"))
                print(f"  saved new best ({best_acc:.2f}%)")

    if rank == 0:
        print(f"Best test accuracy: {best_acc:.2f}%")
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description="DenseNet-BC CIFAR-100 DDP")
    parser.add_argument("--data", default="./data")
    parser.add_argument("--ckpt-dir", default="./checkpoint")
    parser.add_argument("--world-size", type=int, default=torch.cuda.device_count())
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=64, help="per GPU")
    parser.add_argument("--lr", type=float, default=0.1, help="for a total batch of 64")
    parser.add_argument("--port", type=int, default=29555)
    args = parser.parse_args()

    os.makedirs(args.ckpt_dir, exist_ok=True)
    torchvision.datasets.CIFAR100(args.data, train=True, download=True)
    torchvision.datasets.CIFAR100(args.data, train=False, download=True)
    mp.spawn(worker, args=(args.world_size, args), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
