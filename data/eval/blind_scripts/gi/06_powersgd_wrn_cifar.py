"""
WideResNet-28-10 on CIFAR-100 with PowerSGD gradient compression.

Rank-2 PowerSGD with error feedback and warm start, vanilla all-reduce for the
first `--start-powersgd-iter` iterations (as recommended by Vogels et al.).

    torchrun --nproc_per_node=4 06_powersgd_wrn_cifar.py --data-dir ~/data --rank 2
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


class BasicBlock(nn.Module):
    def __init__(self, in_planes, out_planes, stride, drop_rate=0.0):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_planes)
        self.conv1 = nn.Conv2d(in_planes, out_planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_planes)
        self.conv2 = nn.Conv2d(out_planes, out_planes, 3, 1, 1, bias=False)
        self.drop_rate = drop_rate
        self.equal_in_out = in_planes == out_planes and stride == 1
        self.shortcut = None if self.equal_in_out else nn.Conv2d(in_planes, out_planes, 1, stride, bias=False)

    def forward(self, x):
        o = F.relu(self.bn1(x))
        y = self.conv1(o)
        y = F.relu(self.bn2(y))
        if self.drop_rate > 0:
            y = F.dropout(y, p=self.drop_rate, training=self.training)
        y = self.conv2(y)
        return y + (x if self.equal_in_out else self.shortcut(o))


class WideResNet(nn.Module):
    def __init__(self, depth=28, widen=10, num_classes=100, drop_rate=0.3):
        super().__init__()
        n = (depth - 4) // 6
        widths = [16, 16 * widen, 32 * widen, 64 * widen]
        self.conv1 = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)
        layers = []
        in_planes = widths[0]
        for i, stride in enumerate([1, 2, 2]):
            for j in range(n):
                layers.append(BasicBlock(in_planes, widths[i + 1], stride if j == 0 else 1, drop_rate))
                in_planes = widths[i + 1]
        self.blocks = nn.Sequential(*layers)
        self.bn = nn.BatchNorm2d(in_planes)
        self.fc = nn.Linear(in_planes, num_classes)

    def forward(self, x):
        x = self.blocks(self.conv1(x))
        x = F.relu(self.bn(x))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)


def get_loaders(data_dir, batch_size, workers):
    mean, std = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
    train_tf = transforms.Compose([
        transforms.RandomCrop(32, padding=4, padding_mode="reflect"),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    test_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])
    train_set = datasets.CIFAR100(data_dir, train=True, transform=train_tf, download=False)
    test_set = datasets.CIFAR100(data_dir, train=False, transform=test_tf, download=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=42)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=batch_size, sampler=train_sampler,
                              num_workers=workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=512, sampler=test_sampler,
                             num_workers=workers, pin_memory=True)
    return train_loader, test_loader


def evaluate(model, loader, device):
    model.eval()
    total = torch.zeros(3, dtype=torch.float64, device=device)
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            total[0] += F.cross_entropy(logits, y, reduction="sum").double()
            total[1] += (logits.argmax(dim=1) == y).sum()
            total[2] += y.size(0)
    dist.all_reduce(total)
    return (total[0] / total[2]).item(), (100.0 * total[1] / total[2]).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-dir", default=os.path.expanduser("~/data"))
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32, help="per GPU")
    parser.add_argument("--lr", type=float, default=0.1, help="for the global batch of 128")
    parser.add_argument("--wd", type=float, default=5e-4)
    parser.add_argument("--rank", type=int, default=2, help="PowerSGD matrix approximation rank")
    parser.add_argument("--start-powersgd-iter", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--ckpt", default="checkpoints/wrn28_10_powersgd.pt")
    args = parser.parse_args()

    dist.init_process_group(backend="nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()

    train_loader, test_loader = get_loaders(args.data_dir, args.batch_size, args.workers)

    model = WideResNet(num_classes=100)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    state = powerSGD.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=args.rank,
        start_powerSGD_iter=args.start_powersgd_iter,
        min_compression_rate=2,
        use_error_feedback=True,
        warm_start=True,
        random_seed=0,
    )
    model.register_comm_hook(state, powerSGD.powerSGD_hook)

    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.wd,
                                nesterov=True)
    # step decay at 30/60/80% of training, as in the WRN paper
    milestones = [int(args.epochs * f) for f in (0.3, 0.6, 0.8)]
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=milestones, gamma=0.2)

    start_epoch = 0
    if os.path.exists(args.ckpt):
        ckpt = torch.load(args.ckpt, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1
        if rank == 0:
            print(f"resumed from epoch {ckpt['epoch']}")

    for epoch in range(start_epoch, args.epochs):
        model.train()
        t0 = time.time()
        running = 0.0
        for it, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            running += loss.item()
        scheduler.step()

        test_loss, test_acc = evaluate(model, test_loader, device)
        if rank == 0:
            print(f"[{epoch:03d}] train_loss {running / len(train_loader):.4f} "
                  f"test_loss {test_loss:.4f} test_acc {test_acc:.2f} "
                  f"lr {scheduler.get_last_lr()[0]:.4f} ({time.time() - t0:.1f}s)")
            os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch}, args.ckpt)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
