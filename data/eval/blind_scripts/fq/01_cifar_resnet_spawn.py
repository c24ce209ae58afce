"""
Multi-GPU CIFAR-10 training with ResNet-18 using torch.multiprocessing.spawn.

Usage:
    python 01_cifar_resnet_spawn.py --gpus 4 --epochs 100 --batch-size 512
"""
import argparse
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
import torchvision.transforms as T


def get_args():
    p = argparse.ArgumentParser(description="CIFAR-10 ResNet DDP")
    p.add_argument("--data", default="./data")
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=512, help="global batch size")
    p.add_argument("--lr", type=float, default=0.1, help="lr for a global batch of 256")
    p.add_argument("--wd", type=float, default=5e-4)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--resume", default="")
    p.add_argument("--out", default="./checkpoints")
    p.add_argument("--port", type=int, default=29500)
    return p.parse_args()


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
        self.fc = nn.Linear(512, num_classes)

    def _make_layer(self, planes, n, stride):
        layers = []
        for s in [stride] + [1] * (n - 1):
            layers.append(BasicBlock(self.in_planes, planes, s))
            self.in_planes = planes
        return nn.Sequential(*layers)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)


def setup(rank, world_size, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)


def cleanup():
    dist.destroy_process_group()


def build_loaders(args, rank, world_size):
    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    train_tf = T.Compose([
        T.RandomCrop(32, padding=4),
        T.RandomHorizontalFlip(),
        T.ToTensor(),
        T.Normalize(mean, std),
    ])
    test_tf = T.Compose([T.ToTensor(), T.Normalize(mean, std)])

    # dataset is downloaded once in the parent process before spawning
    train_set = torchvision.datasets.CIFAR10(args.data, train=True, download=False, transform=train_tf)
    test_set = torchvision.datasets.CIFAR10(args.data, train=False, download=False, transform=test_tf)

    per_gpu_bs = args.batch_size // world_size
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    test_sampler = DistributedSampler(test_set, num_replicas=world_size, rank=rank, shuffle=False)

    train_loader = DataLoader(train_set, batch_size=per_gpu_bs, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=args.workers > 0)
    test_loader = DataLoader(test_set, batch_size=per_gpu_bs, sampler=test_sampler,
                             num_workers=args.workers, pin_memory=True)
    return train_loader, test_loader, train_sampler


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # loss_sum, correct, count
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        out = model(x)
        stats[0] += F.cross_entropy(out, y, reduction="sum")
        stats[1] += (out.argmax(1) == y).sum()
        stats[2] += y.numel()
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main_worker(rank, world_size, args):
    setup(rank, world_size, args.port)
    device = torch.device("cuda", rank)
    torch.manual_seed(42)
    torch.backends.cudnn.benchmark = True

    train_loader, test_loader, train_sampler = build_loaders(args, rank, world_size)

    model = ResNet18(num_classes=10)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    model = DDP(model, device_ids=[rank], output_device=rank)

    lr = args.lr * args.batch_size / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9,
                                weight_decay=args.wd, nesterov=True)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=lr, epochs=args.epochs, steps_per_epoch=len(train_loader))
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    start_epoch, best_acc = 0, 0.0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_acc = ckpt["epoch"] + 1, ckpt["best_acc"]
        if rank == 0:
            print(f"=> resumed from {args.resume} (epoch {ckpt['epoch']})")

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for step, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.cuda.amp.autocast(enabled=args.amp):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            running[0] += loss.detach() * y.size(0)
            running[1] += y.size(0)

        dist.all_reduce(running)
        train_loss = (running[0] / running[1]).item()
        val_loss, val_acc = evaluate(model, test_loader, device)

        if rank == 0:
            print(f"epoch {epoch:3d} | train {train_loss:.4f} | val {val_loss:.4f} "
                  f"acc {val_acc * 100:.2f}% | {time.time() - t0:.1f}s")
            is_best = val_acc > best_acc
            best_acc = max(best_acc, val_acc)
            state = {
                "epoch": epoch,
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict(),
                "best_acc": best_acc,
            }
            os.makedirs(args.out, exist_ok=True)
            torch.save(state, os.path.join(args.out, "last.pth"))
            if is_best:
                torch.save(state, os.path.join(args.out, "best.pth"))
        dist.barrier()

    if rank == 0:
        print(f"done. best acc {best_acc * 100:.2f}%")
    cleanup()


if __name__ == "__main__":
    args = get_args()
    # download in the parent so the workers never race on the archive
    torchvision.datasets.CIFAR10(args.data, train=True, download=True)
    torchvision.datasets.CIFAR10(args.data, train=False, download=True)
    world_size = args.gpus
    assert world_size <= torch.cuda.device_count(), "not enough GPUs"
    mp.spawn(main_worker, args=(world_size, args), nprocs=world_size, join=True)
