#!/usr/bin/env python3
"""R2-D2: meta-learning with a differentiable closed-form ridge-regression head.

CIFAR-FS (Bertinetto et al. 2019). Each GPU builds its own episodes; the backbone
and the two learnable head scalars (lambda, output scale) are trained with DDP.

    torchrun --standalone --nproc_per_node=4 03_r2d2_ridge_cifarfs.py \
        --data /data/cifar_fs --shot 5 --out runs/r2d2_5shot
"""
import argparse
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
import torchvision.transforms as T


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/cifar_fs")
    ap.add_argument("--out", default="runs/r2d2")
    ap.add_argument("--way", type=int, default=5)
    ap.add_argument("--train-way", type=int, default=16)
    ap.add_argument("--shot", type=int, default=5)
    ap.add_argument("--query", type=int, default=6)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--episodes-per-epoch", type=int, default=2000)
    ap.add_argument("--val-episodes", type=int, default=2000)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=42)
    return ap.parse_args()


class CIFARFS(Dataset):
    """Pickles as released with MetaOptNet: {'data': uint8[N,32,32,3], 'labels': list}."""

    def __init__(self, root, phase, augment):
        with open(os.path.join(root, f"CIFAR_FS_{phase}.pickle"), "rb") as f:
            blob = pickle.load(f, encoding="latin1")
        self.images = blob["data"]
        raw = np.asarray(blob["labels"])
        classes = sorted(set(raw.tolist()))
        remap = {c: i for i, c in enumerate(classes)}
        self.labels = np.array([remap[c] for c in raw])
        norm = T.Normalize([0.5071, 0.4865, 0.4409], [0.2673, 0.2564, 0.2762])
        if augment:
            self.tf = T.Compose([T.ToPILImage(), T.RandomCrop(32, padding=4), T.ColorJitter(0.4, 0.4, 0.4),
                                 T.RandomHorizontalFlip(), T.ToTensor(), norm])
        else:
            self.tf = T.Compose([T.ToPILImage(), T.ToTensor(), norm])

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.tf(self.images[i]), int(self.labels[i])


class EpisodicBatchSampler:
    def __init__(self, labels, episodes, way, per_class, seed):
        self.by_class = [np.flatnonzero(labels == c) for c in range(labels.max() + 1)]
        self.episodes, self.way, self.per_class = episodes, way, per_class
        self.rs = np.random.RandomState(seed)

    def __len__(self):
        return self.episodes

    def __iter__(self):
        for _ in range(self.episodes):
            cls = self.rs.choice(len(self.by_class), self.way, replace=False)
            idx = np.stack([self.rs.choice(self.by_class[c], self.per_class, replace=False) for c in cls])
            yield idx.T.reshape(-1).tolist()  # class-minor order: label = position % way


def block(cin, cout, pool=True, drop=0.0):
    layers = [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout)]
    if pool:
        layers.append(nn.MaxPool2d(2))
    layers.append(nn.LeakyReLU(0.1))
    if drop > 0:
        layers.append(nn.Dropout(drop))
    return nn.Sequential(*layers)


class R2D2Embedding(nn.Module):
    """96-192-384-512 conv net; features of the last two blocks are concatenated."""

    def __init__(self):
        super().__init__()
        self.b1 = block(3, 96)
        self.b2 = block(96, 192)
        self.b3 = block(192, 384, drop=0.1)
        self.b4 = block(384, 512, pool=False, drop=0.3)

    def forward(self, x):
        x = self.b2(self.b1(x))
        h3 = self.b3(x)
        h4 = self.b4(h3)
        return torch.cat([h3.flatten(1), h4.flatten(1)], dim=1)


class R2D2(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = R2D2Embedding()
        self.log_lam = nn.Parameter(torch.tensor(0.0))
        self.scale = nn.Parameter(torch.tensor(1e-4))
        self.bias = nn.Parameter(torch.tensor(0.0))

    def forward(self, images, way, shot):
        feats = self.embed(images)
        n_s = way * shot
        xs, xq = feats[:n_s], feats[n_s:]
        ys = F.one_hot(torch.arange(way, device=images.device).repeat(shot), way).float()
        # Woodbury form: W = Xs^T (Xs Xs^T + lam I)^-1 Ys, an n_s x n_s solve instead of d x d
        gram = xs @ xs.t() + self.log_lam.exp() * torch.eye(n_s, device=xs.device)
        w = xs.t() @ torch.linalg.solve(gram, ys)
        return self.scale * (xq @ w) + self.bias


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(args.seed)
    is_main = rank == 0
    if is_main:
        os.makedirs(args.out, exist_ok=True)

    train_ds = CIFARFS(args.data, "train", augment=True)
    val_ds = CIFARFS(args.data, "val", augment=False)
    train_dl = DataLoader(
        train_ds,
        batch_sampler=EpisodicBatchSampler(train_ds.labels, args.episodes_per_epoch // world, args.train_way,
                                           args.shot + args.query, seed=args.seed + 17 * rank),
        num_workers=args.workers, pin_memory=True, persistent_workers=True)

    model = R2D2().to(dev)
    model = DistributedDataParallel(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.5)

    train_y = torch.arange(args.train_way, device=dev).repeat(args.query)
    val_y = torch.arange(args.way, device=dev).repeat(args.query)
    best = -1.0

    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        loss_acc = torch.zeros(2, device=dev)
        for x, _ in train_dl:
            x = x.to(dev, non_blocking=True)
            logits = model(x, args.train_way, args.shot)
            loss = F.cross_entropy(logits, train_y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_acc[0] += loss.detach()
            loss_acc[1] += 1
        sched.step()
        dist.all_reduce(loss_acc)

        # meta-validation: fixed episodes (same seed every epoch), split across GPUs
        model.eval()
        val_dl = DataLoader(
            val_ds,
            batch_sampler=EpisodicBatchSampler(val_ds.labels, args.val_episodes // world, args.way,
                                               args.shot + args.query, seed=999 + rank),
            num_workers=args.workers, pin_memory=True)
        acc_sum, acc_sq, n = 0.0, 0.0, 0
        with torch.no_grad():
            for x, _ in val_dl:
                logits = model(x.to(dev, non_blocking=True), args.way, args.shot)
                a = (logits.argmax(1) == val_y).float().mean().item()
                acc_sum += a
                acc_sq += a * a
                n += 1
        stats = torch.tensor([acc_sum, acc_sq, n], dtype=torch.float64)
        dist.all_reduce(stats)
        mean = stats[0] / stats[2]
        ci95 = 1.96 * torch.sqrt(stats[1] / stats[2] - mean ** 2) / torch.sqrt(stats[2])

        if is_main:
            print(f"epoch {epoch:3d} | loss {(loss_acc[0] / loss_acc[1]).item():.4f} | "
                  f"val {100 * mean:.2f} +- {100 * ci95:.2f} | lam {model.module.log_lam.exp().item():.3f} "
                  f"| {time.time() - t0:.0f}s", flush=True)
            ckpt = {"epoch": epoch, "model": model.module.state_dict(), "opt": opt.state_dict()}
            torch.save(ckpt, os.path.join(args.out, "last.pt"))
            if mean.item() > best:
                best = mean.item()
                torch.save(ckpt, os.path.join(args.out, "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
