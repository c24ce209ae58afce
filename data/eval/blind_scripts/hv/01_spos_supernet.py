#!/usr/bin/env python3
"""Single-path one-shot (SPOS) supernet training on an ImageNet-100 subset.

Every step trains one uniformly sampled path through the supernet.  All ranks
draw the same path for a given step (the RNG is seeded from the global step),
so the gradient all-reduce averages gradients of the same sub-network.
"""
import argparse
import json
import logging
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

logger = logging.getLogger("spos")

# (out_channels, num_blocks, first_stride)
STAGES = [(48, 4, 2), (96, 4, 2), (192, 8, 2), (384, 4, 2)]
KERNELS = [3, 5, 7]


class InvertedResidual(nn.Module):
    def __init__(self, cin, cout, stride, kernel, expand=4):
        super().__init__()
        mid = cin * expand
        self.use_res = stride == 1 and cin == cout
        self.body = nn.Sequential(
            nn.Conv2d(cin, mid, 1, bias=False),
            nn.BatchNorm2d(mid),
            nn.ReLU6(inplace=True),
            nn.Conv2d(mid, mid, kernel, stride, kernel // 2, groups=mid, bias=False),
            nn.BatchNorm2d(mid),
            nn.ReLU6(inplace=True),
            nn.Conv2d(mid, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        )

    def forward(self, x):
        out = self.body(x)
        return x + out if self.use_res else out


class ChoiceBlock(nn.Module):
    """Holds one candidate op per kernel size; the last choice is identity when allowed."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.ops = nn.ModuleList([InvertedResidual(cin, cout, stride, k) for k in KERNELS])
        self.can_skip = stride == 1 and cin == cout

    @property
    def num_choices(self):
        return len(self.ops) + int(self.can_skip)

    def forward(self, x, choice):
        if choice == len(self.ops):
            return x
        return self.ops[choice](x)


class Supernet(nn.Module):
    def __init__(self, num_classes=100):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 24, 3, 2, 1, bias=False), nn.BatchNorm2d(24), nn.ReLU6(inplace=True)
        )
        blocks, cin = [], 24
        for cout, n, stride in STAGES:
            for i in range(n):
                blocks.append(ChoiceBlock(cin, cout, stride if i == 0 else 1))
                cin = cout
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Sequential(
            nn.Conv2d(cin, 1280, 1, bias=False), nn.BatchNorm2d(1280), nn.ReLU6(inplace=True)
        )
        self.fc = nn.Linear(1280, num_classes)

    def sample_arch(self, rng):
        return [rng.randrange(b.num_choices) for b in self.blocks]

    def forward(self, x, arch):
        x = self.stem(x)
        for block, choice in zip(self.blocks, arch):
            x = block(x, choice)
        x = self.head(x)
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/datasets/imagenet100")
    p.add_argument("--out", default="./output/spos")
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=1024, help="global batch size")
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--wd", type=float, default=4e-5)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--eval-paths", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def build_loaders(args, rank, world_size):
    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), norm,
    ])
    val_tf = transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm,
    ])
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    # strided shard so every val image is counted exactly once
    val_set = Subset(val_set, list(range(rank, len(val_set), world_size)))

    per_gpu = args.batch_size // world_size
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=per_gpu, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=per_gpu, shuffle=False,
                            num_workers=args.workers, pin_memory=True)
    return train_loader, val_loader, train_sampler


@torch.no_grad()
def evaluate_path(net, loader, arch, device):
    net.eval()
    stats = torch.zeros(2, device=device)
    for images, targets in loader:
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        logits = net(images, arch)
        stats[0] += (logits.argmax(1) == targets).sum()
        stats[1] += targets.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")
    torch.manual_seed(args.seed)
    torch.backends.cudnn.benchmark = True

    train_loader, val_loader, train_sampler = build_loaders(args, rank, world_size)

    model = Supernet(num_classes=100).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    net = model.module

    # no weight decay on BN / bias
    decay, no_decay = [], []
    for name, p in net.named_parameters():
        (no_decay if p.ndim <= 1 else decay).append(p)
    optimizer = torch.optim.SGD(
        [{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, momentum=0.9, nesterov=True,
    )
    total_steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - s / total_steps)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    global_step = 0
    for epoch in range(args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for images, targets in train_loader:
            images = images.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            # same path on every rank for this step
            arch = net.sample_arch(random.Random(args.seed * 1_000_003 + global_step))
            logits = model(images, arch)
            loss = criterion(logits, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(net.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            global_step += 1
            running[0] += loss.detach()
            running[1] += 1

        dist.all_reduce(running)
        train_loss = (running[0] / running[1]).item()

        eval_rng = random.Random(10_000 + epoch)
        accs = []
        for _ in range(args.eval_paths):
            arch = net.sample_arch(eval_rng)
            accs.append(evaluate_path(net, val_loader, arch, device))

        if rank == 0:
            logger.info("epoch %d loss %.4f path-acc mean %.4f max %.4f (%.0fs)",
                        epoch, train_loss, sum(accs) / len(accs), max(accs), time.time() - t0)
            torch.save({"epoch": epoch, "model": net.state_dict(),
                        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
                       os.path.join(args.out, "supernet_last.pt"))
            with open(os.path.join(args.out, "log.jsonl"), "a") as f:
                f.write(json.dumps({"epoch": epoch, "loss": train_loss, "accs": accs}) + "\n")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
