"""FairNAS supernet training with strict fairness.

For every batch, m = number of choices models are sampled so that each choice
block of every layer is activated exactly once; their gradients are
accumulated and a single optimizer step is taken.

    torchrun --nproc_per_node=8 07_fairnas_supernet.py --data-dir /datasets/imagenet \
        --output runs/fairnas
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, transforms

# (expansion, kernel) of the six inverted-residual choices
CHOICES = [(3, 3), (3, 5), (3, 7), (6, 3), (6, 5), (6, 7)]
# (out channels, blocks, first stride)
STAGES = [(32, 4, 2), (40, 4, 2), (80, 4, 2), (96, 4, 1), (192, 4, 2), (320, 1, 1)]


def parse_args():
    parser = argparse.ArgumentParser(description="FairNAS supernet")
    parser.add_argument("--data-dir", type=str, required=True)
    parser.add_argument("--output", type=str, default="runs/fairnas")
    parser.add_argument("--epochs", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=128, help="per process")
    parser.add_argument("--lr", type=float, default=0.045, help="lr for a global batch of 256")
    parser.add_argument("--weight-decay", type=float, default=4e-5)
    parser.add_argument("--workers", type=int, default=10)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


class InvertedResidual(nn.Module):
    def __init__(self, inp, oup, stride, expand, kernel):
        super().__init__()
        hidden = inp * expand
        self.use_res = stride == 1 and inp == oup
        self.conv = nn.Sequential(
            nn.Conv2d(inp, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, hidden, kernel, stride, kernel // 2, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden), nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, oup, 1, bias=False), nn.BatchNorm2d(oup))

    def forward(self, x):
        out = self.conv(x)
        return x + out if self.use_res else out


class FairSuperNet(nn.Module):
    def __init__(self, num_classes=1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, 2, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU6(inplace=True),
                                  nn.Conv2d(32, 32, 3, 1, 1, groups=32, bias=False), nn.BatchNorm2d(32),
                                  nn.ReLU6(inplace=True), nn.Conv2d(32, 16, 1, bias=False), nn.BatchNorm2d(16))
        self.blocks = nn.ModuleList()
        inp = 16
        for oup, n, s in STAGES:
            for i in range(n):
                self.blocks.append(nn.ModuleList(
                    [InvertedResidual(inp, oup, s if i == 0 else 1, e, k) for e, k in CHOICES]))
                inp = oup
        self.head = nn.Sequential(nn.Conv2d(inp, 1280, 1, bias=False), nn.BatchNorm2d(1280), nn.ReLU6(inplace=True))
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(1280, num_classes))

    def forward(self, x, arch):
        x = self.stem(x)
        for layer, c in zip(self.blocks, arch):
            x = layer[c](x)
        x = self.head(x)
        return self.classifier(F.adaptive_avg_pool2d(x, 1).flatten(1))


def fair_sample(rng, num_layers, m=len(CHOICES)):
    """m architectures; each layer's choices form a permutation across them."""
    perms = np.stack([rng.permutation(m) for _ in range(num_layers)], axis=1)
    return [perms[i].tolist() for i in range(m)]


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    torch.manual_seed(args.seed)

    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_set = datasets.ImageFolder(os.path.join(args.data_dir, "train"), transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
        transforms.ColorJitter(0.4, 0.4, 0.4), transforms.ToTensor(), normalize]))
    val_set = datasets.ImageFolder(os.path.join(args.data_dir, "val"), transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), normalize]))
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world_size)),
                            batch_size=250, num_workers=args.workers, pin_memory=True)

    model = FairSuperNet().to(device)
    num_layers = len(model.blocks)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank,
                find_unused_parameters=True)

    lr = args.lr * args.batch_size * world_size / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=args.weight_decay,
                                nesterov=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(loader))
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    writer = SummaryWriter(args.output) if rank == 0 else None

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        rng = np.random.RandomState(args.seed + epoch)  # same on all ranks
        tic = time.time()
        for it, (images, labels) in enumerate(loader):
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            optimizer.zero_grad()
            for arch in fair_sample(rng, num_layers):
                loss = criterion(model(images, arch), labels)
                loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            if rank == 0 and it % 100 == 0:
                gstep = epoch * len(loader) + it
                writer.add_scalar("loss", loss.item(), gstep)
                writer.add_scalar("lr", scheduler.get_last_lr()[0], gstep)
                print(f"[{epoch}][{it}/{len(loader)}] loss {loss.item():.4f} ({time.time() - tic:.1f}s)")

        # accuracy of a few fair paths (BN stats are shared across paths, so this is only indicative)
        model.eval()
        acc = torch.zeros(2, device=device)
        with torch.no_grad():
            archs = fair_sample(np.random.RandomState(0), num_layers)[:2]
            for images, labels in val_loader:
                images = images.to(device, non_blocking=True)
                labels = labels.to(device, non_blocking=True)
                for arch in archs:
                    acc[0] += (model(images, arch).argmax(1) == labels).sum()
                acc[1] += labels.numel() * len(archs)
        dist.all_reduce(acc)
        if rank == 0:
            writer.add_scalar("val_top1", (100 * acc[0] / acc[1]).item(), epoch)
            os.makedirs(args.output, exist_ok=True)
            torch.save({"epoch": epoch, "state_dict": model.module.state_dict(),
                        "optimizer": optimizer.state_dict()}, os.path.join(args.output, "checkpoint.pth.tar"))
        dist.barrier()

    if writer:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
