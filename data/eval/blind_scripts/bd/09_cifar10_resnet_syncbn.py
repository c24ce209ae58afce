"""
ResNet-20 (He et al. 2016, CIFAR version) on CIFAR-10 with DDP + SyncBatchNorm + AMP.

    torchrun --standalone --nproc_per_node=8 09_cifar10_resnet_syncbn.py --epochs 160

Per-GPU batch is small (32) when using 8 GPUs, so BatchNorm is synchronised
across GPUs. Learning rate follows the linear scaling rule with 5 warmup epochs.
"""
import argparse
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
import torchvision
import torchvision.transforms as T


# ---------------------------------------------------------------- ResNet-20
class BasicBlock(nn.Module):
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


class ResNet(nn.Module):
    def __init__(self, num_blocks=(3, 3, 3), num_classes=10):
        super().__init__()
        self.in_planes = 16
        self.conv1 = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.layer1 = self._make_layer(16, num_blocks[0], 1)
        self.layer2 = self._make_layer(32, num_blocks[1], 2)
        self.layer3 = self._make_layer(64, num_blocks[2], 2)
        self.linear = nn.Linear(64, num_classes)

    def _make_layer(self, planes, n, stride):
        layers = []
        for s in [stride] + [1] * (n - 1):
            layers.append(BasicBlock(self.in_planes, planes, s))
            self.in_planes = planes
        return nn.Sequential(*layers)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer3(self.layer2(self.layer1(out)))
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.linear(out)


# ---------------------------------------------------------------- helpers
def is_main():
    return dist.get_rank() == 0


def print0(*a, **kw):
    if is_main():
        print(*a, **kw, flush=True)


def lr_at(epoch_float, base_lr, warmup, total):
    if epoch_float < warmup:
        return base_lr * epoch_float / warmup
    progress = (epoch_float - warmup) / max(1, total - warmup)
    return 0.5 * base_lr * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate(model, loader, device):
    # `model` is the bare module here: there are no collectives inside the loop,
    # so it does not matter that the ranks get a different number of batches
    model.eval()
    stats = torch.zeros(3, device=device)  # loss_sum, correct, count
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        out = model(x)
        stats[0] += F.cross_entropy(out, y, reduction="sum")
        stats[1] += (out.argmax(1) == y).sum()
        stats[2] += y.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="./data")
    p.add_argument("--epochs", type=int, default=160)
    p.add_argument("--batch-size", type=int, default=32, help="per GPU")
    p.add_argument("--base-lr", type=float, default=0.1, help="lr for a global batch of 128")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--out", default="runs/resnet20")
    p.add_argument("--resume", default="")
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    norm = T.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    train_tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), norm])
    test_tf = T.Compose([T.ToTensor(), norm])

    if rank == 0:
        torchvision.datasets.CIFAR10(args.data, train=True, download=True)
        torchvision.datasets.CIFAR10(args.data, train=False, download=True)
        os.makedirs(args.out, exist_ok=True)
    dist.barrier()
    train_set = torchvision.datasets.CIFAR10(args.data, train=True, transform=train_tf)
    test_set = torchvision.datasets.CIFAR10(args.data, train=False, transform=test_tf)

    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True, persistent_workers=True)
    # strided shard of the test set: no padding / duplicated images, so the
    # all-reduced accuracy is exactly the accuracy on the 10000 test images
    test_shard = Subset(test_set, list(range(rank, len(test_set), world)))
    test_loader = DataLoader(test_shard, batch_size=256, shuffle=False, num_workers=2, pin_memory=True)

    model = ResNet()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    model = DDP(model, device_ids=[local_rank])

    global_batch = args.batch_size * world
    peak_lr = args.base_lr * global_batch / 128
    optimizer = torch.optim.SGD(model.parameters(), lr=peak_lr, momentum=0.9,
                                weight_decay=args.wd, nesterov=True)
    scaler = torch.cuda.amp.GradScaler()
    print0(f"world={world} global_batch={global_batch} peak_lr={peak_lr:.3f}")

    start_epoch, best = 0, 0.0
    if args.resume:
        ck = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scaler.load_state_dict(ck["scaler"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]
        print0(f"resumed from {args.resume} at epoch {start_epoch}")

    steps_per_epoch = len(train_loader)
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_loader):
            lr = lr_at(epoch + i / steps_per_epoch, peak_lr, args.warmup, args.epochs)
            for g in optimizer.param_groups:
                g["lr"] = lr
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.cuda.amp.autocast():
                loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if i % 100 == 0:
                print0(f"ep {epoch:3d} it {i:4d}/{steps_per_epoch} loss {loss.item():.3f} lr {lr:.4f}")

        test_loss, acc = evaluate(model.module, test_loader, device)
        print0(f"== epoch {epoch}: test loss {test_loss:.4f} acc {acc * 100:.2f}% ({time.time() - t0:.0f}s)")

        if rank == 0:
            ck = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                  "scaler": scaler.state_dict(), "epoch": epoch, "best": max(best, acc)}
            torch.save(ck, os.path.join(args.out, "last.pt"))
            if acc > best:
                torch.save(ck, os.path.join(args.out, "best.pt"))
        best = max(best, acc)

    print0(f"best acc {best * 100:.2f}%")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
