"""Random search over ResNet-style architectures and optimiser settings.

Trials run back to back inside one torchrun job: every trial builds a fresh
model, trains it for a short budget on CIFAR-100 and is scored on the held-out
split.  Results go to a CSV on rank 0.
"""
import argparse
import csv
import os
import random
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

SEARCH_SPACE = {
    "depth": [(1, 1, 1), (2, 2, 2), (2, 3, 4), (3, 4, 6)],
    "width": [32, 48, 64, 96],
    "lr": (0.02, 0.4),          # log-uniform
    "weight_decay": (1e-5, 1e-3),  # log-uniform
    "label_smoothing": [0.0, 0.1],
}


def sample_config(space):
    def log_uniform(lo, hi):
        return float(np.exp(random.uniform(np.log(lo), np.log(hi))))

    return {
        "depth": random.choice(space["depth"]),
        "width": random.choice(space["width"]),
        "lr": log_uniform(*space["lr"]),
        "weight_decay": log_uniform(*space["weight_decay"]),
        "label_smoothing": random.choice(space["label_smoothing"]),
    }


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = None
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.short is None else self.short(x)))


class ResNet(nn.Module):
    def __init__(self, depth, width, num_classes=100):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        layers, cin = [], width
        for stage, n in enumerate(depth):
            cout = width * 2 ** stage
            for i in range(n):
                layers.append(BasicBlock(cin, cout, 2 if (i == 0 and stage > 0) else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", default="/data/cifar100")
    p.add_argument("--out", default="results/random_search")
    p.add_argument("--trials", type=int, default=40)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=128, help="per-GPU batch")
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)


def make_data(args, rank, world):
    mean, std = (0.507, 0.487, 0.441), (0.267, 0.256, 0.276)
    train_tf = T.Compose([T.RandomCrop(32, 4), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(mean, std)])
    test_tf = T.Compose([T.ToTensor(), T.Normalize(mean, std)])
    # the 50k train images are split 45k/5k with a fixed generator; test set is never touched here
    train_full = torchvision.datasets.CIFAR100(args.data_dir, train=True, transform=train_tf)
    eval_full = torchvision.datasets.CIFAR100(args.data_dir, train=True, transform=test_tf)
    perm = torch.randperm(len(train_full), generator=torch.Generator().manual_seed(0)).tolist()
    train_set = Subset(train_full, perm[:45000])
    holdout = Subset(eval_full, perm[45000:])
    holdout = Subset(holdout, list(range(rank, len(holdout), world)))

    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    eval_loader = DataLoader(holdout, 512, num_workers=args.workers, pin_memory=True)
    return train_loader, eval_loader, sampler


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        out = model(x)
        acc[0] += F.cross_entropy(out, y, reduction="sum")
        acc[1] += (out.argmax(1) == y).sum()
        acc[2] += y.numel()
    dist.all_reduce(acc)
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def run_trial(cfg, args, loaders, device, local_rank):
    train_loader, eval_loader, sampler = loaders
    model = ResNet(cfg["depth"], cfg["width"]).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9,
                          weight_decay=cfg["weight_decay"], nesterov=True)
    steps = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg["lr"], total_steps=steps, pct_start=0.15)
    crit = nn.CrossEntropyLoss(label_smoothing=cfg["label_smoothing"])
    scaler = torch.cuda.amp.GradScaler()

    for epoch in range(args.epochs):
        model.train()
        sampler.set_epoch(epoch)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = crit(model(x), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
    val_loss, val_acc = evaluate(model, eval_loader, device)
    n_params = sum(p.numel() for p in model.parameters())
    del model, opt, sched
    torch.cuda.empty_cache()
    return val_loss, val_acc, n_params


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # different augmentation streams per rank
    seed_everything(args.seed + rank)

    loaders = make_data(args, rank, world)
    writer = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        fh = open(os.path.join(args.out, "trials.csv"), "w", newline="")
        writer = csv.writer(fh)
        writer.writerow(["trial", "depth", "width", "lr", "wd", "ls", "val_loss", "val_acc", "params", "secs"])

    best = (-1.0, None)
    for trial in range(args.trials):
        cfg = sample_config(SEARCH_SPACE)
        t0 = time.time()
        val_loss, val_acc, n_params = run_trial(cfg, args, loaders, device, local_rank)
        if rank == 0:
            writer.writerow([trial, "-".join(map(str, cfg["depth"])), cfg["width"], f"{cfg['lr']:.4g}",
                             f"{cfg['weight_decay']:.3g}", cfg["label_smoothing"], f"{val_loss:.4f}",
                             f"{val_acc:.4f}", n_params, int(time.time() - t0)])
            fh.flush()
            print(f"trial {trial}: {cfg} -> acc {val_acc:.4f}", flush=True)
            if val_acc > best[0]:
                best = (val_acc, cfg)

    if rank == 0:
        print("best:", best)
        fh.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
