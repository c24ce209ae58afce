"""
WideResNet-16-8 on STL-10 (labelled train split, 96x96), trained with DDP via mp.spawn.

    python 09_stl10_wideresnet.py --nprocs 4 --epochs 120
"""
import argparse
import logging
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
from torchvision import datasets, transforms


class WideBasic(nn.Module):
    def __init__(self, in_planes, planes, dropout, stride=1):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_planes)
        self.conv1 = nn.Conv2d(in_planes, planes, 3, padding=1, bias=False)
        self.dropout = nn.Dropout(dropout)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False))

    def forward(self, x):
        out = self.dropout(self.conv1(F.relu(self.bn1(x))))
        out = self.conv2(F.relu(self.bn2(out)))
        return out + self.shortcut(x)


class WideResNet(nn.Module):
    def __init__(self, depth=16, widen=8, dropout=0.3, num_classes=10):
        super().__init__()
        n = (depth - 4) // 6
        widths = [16, 16 * widen, 32 * widen, 64 * widen]
        self.conv1 = nn.Conv2d(3, widths[0], 3, padding=1, bias=False)
        layers, in_planes = [], widths[0]
        for i, (w, s) in enumerate(zip(widths[1:], [1, 2, 2])):
            for j in range(n):
                layers.append(WideBasic(in_planes, w, dropout, s if j == 0 else 1))
                in_planes = w
        self.layers = nn.Sequential(*layers)
        self.bn = nn.BatchNorm2d(in_planes)
        self.fc = nn.Linear(in_planes, num_classes)

    def forward(self, x):
        out = self.layers(self.conv1(x))
        out = F.relu(self.bn(out))
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.fc(out)


def get_logger(rank, log_file):
    logger = logging.getLogger(f"stl10.rank{rank}")
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    fmt = logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S")
    sh = logging.StreamHandler()
    sh.setFormatter(fmt)
    logger.addHandler(sh)
    if rank == 0:
        fh = logging.FileHandler(log_file)
        fh.setFormatter(fmt)
        logger.addHandler(fh)
    return logger


def setup(rank, world_size, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)


def evaluate(model, loader, device):
    model.eval()
    correct = torch.zeros(1, device=device)
    total = torch.zeros(1, device=device)
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            correct += (model(x).argmax(1) == y).sum()
            total += y.numel()
    dist.all_reduce(correct)
    dist.all_reduce(total)
    return (correct / total).item()


def main_worker(rank, args):
    setup(rank, args.nprocs, args.port)
    device = torch.device("cuda", rank)
    os.makedirs(args.out, exist_ok=True)
    logger = get_logger(rank, os.path.join(args.out, "train.log"))

    mean, std = (0.4467, 0.4398, 0.4066), (0.2603, 0.2566, 0.2713)
    train_tf = transforms.Compose([
        transforms.RandomCrop(96, padding=12, padding_mode="reflect"),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    test_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])
    train_set = datasets.STL10(args.data, split="train", transform=train_tf)
    test_set = datasets.STL10(args.data, split="test", transform=test_tf)

    train_sampler = DistributedSampler(train_set, num_replicas=args.nprocs, rank=rank,
                                       shuffle=True, seed=args.seed)
    test_sampler = DistributedSampler(test_set, num_replicas=args.nprocs, rank=rank, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=200, sampler=test_sampler,
                             num_workers=args.workers, pin_memory=True)

    torch.manual_seed(args.seed)
    model = WideResNet(depth=16, widen=8, dropout=0.3).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[rank])

    total_bs = args.batch_size * args.nprocs
    lr = args.lr * total_bs / 128
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9,
                                weight_decay=5e-4, nesterov=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_loader))
    logger.info(f"world size {args.nprocs}, total batch {total_bs}, lr {lr:.3f}, "
                f"{len(train_loader)} steps/epoch")

    best = 0.0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(1, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            loss_sum += loss.detach()
        dist.all_reduce(loss_sum)
        avg_loss = loss_sum.item() / (len(train_loader) * args.nprocs)

        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            acc = evaluate(model, test_loader, device)
            logger.info(f"epoch {epoch + 1} loss {avg_loss:.4f} test acc {acc * 100:.2f}% "
                        f"({time.time() - t0:.1f}s)")
            if rank == 0 and acc > best:
                best = acc
                torch.save(model.module.state_dict(), os.path.join(args.out, "wrn16_8_best.pth"))
        else:
            logger.info(f"epoch {epoch + 1} loss {avg_loss:.4f} ({time.time() - t0:.1f}s)")

    logger.info(f"best test acc {best * 100:.2f}%")
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="./data")
    parser.add_argument("--out", default="./runs/stl10_wrn")
    parser.add_argument("--nprocs", type=int, default=torch.cuda.device_count())
    parser.add_argument("--epochs", type=int, default=120)
    parser.add_argument("--batch-size", type=int, default=32, help="per GPU")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=29541)
    args = parser.parse_args()

    datasets.STL10(args.data, split="train", download=True)
    datasets.STL10(args.data, split="test", download=True)
    mp.spawn(main_worker, args=(args,), nprocs=args.nprocs, join=True)
