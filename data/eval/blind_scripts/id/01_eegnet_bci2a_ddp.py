#!/usr/bin/env python
"""EEGNet-v4 on BCI Competition IV 2a (4-class motor imagery), pooled subjects.

Data is expected as one .npz per subject produced by prepare_bci2a.py:
    X:       (n_trials, n_channels, n_times) float32, 4-38 Hz band-pass, 250 Hz
    y:       (n_trials,) int64 in [0, 3]  (left hand, right hand, feet, tongue)
    session: (n_trials,) 0 = session T (training), 1 = session E (evaluation)

Training uses session T of all selected subjects, evaluation uses session E.
"""
import argparse
import json
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset
from torch.utils.tensorboard import SummaryWriter


def get_args():
    p = argparse.ArgumentParser(description="EEGNet BCI-IV-2a")
    p.add_argument("--data_dir", type=str, required=True)
    p.add_argument("--out_dir", type=str, default="runs/eegnet_bci2a")
    p.add_argument("--subjects", type=int, nargs="+", default=list(range(1, 10)))
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--batch_size", type=int, default=64, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--dropout", type=float, default=0.5)
    p.add_argument("--F1", type=int, default=8)
    p.add_argument("--D", type=int, default=2)
    p.add_argument("--kern_len", type=int, default=64)
    p.add_argument("--num_workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=2024)
    p.add_argument("--local_rank", type=int, default=0)
    return p.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class BCI2aTrials(Dataset):
    def __init__(self, data_dir, subjects, session, augment=False):
        xs, ys = [], []
        for sub in subjects:
            d = np.load(Path(data_dir) / f"A{sub:02d}.npz")
            keep = d["session"] == session
            xs.append(d["X"][keep].astype(np.float32))
            ys.append(d["y"][keep].astype(np.int64))
        self.X = np.concatenate(xs)
        self.y = np.concatenate(ys)
        self.augment = augment

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        x = self.X[i]
        # trial-wise channel standardisation
        x = (x - x.mean(axis=1, keepdims=True)) / (x.std(axis=1, keepdims=True) + 1e-6)
        if self.augment:
            shift = np.random.randint(-25, 26)
            x = np.roll(x, shift, axis=1)
            x = x + 0.05 * np.random.randn(*x.shape).astype(np.float32)
        return torch.from_numpy(x).unsqueeze(0), self.y[i]


class EEGNet(nn.Module):
    def __init__(self, n_chans, n_classes, n_times, F1=8, D=2, kern_len=64, dropout=0.5):
        super().__init__()
        F2 = F1 * D
        self.block1 = nn.Sequential(
            nn.Conv2d(1, F1, (1, kern_len), padding=(0, kern_len // 2), bias=False),
            nn.BatchNorm2d(F1),
            nn.Conv2d(F1, F1 * D, (n_chans, 1), groups=F1, bias=False),
            nn.BatchNorm2d(F1 * D),
            nn.ELU(),
            nn.AvgPool2d((1, 4)),
            nn.Dropout(dropout),
        )
        self.block2 = nn.Sequential(
            nn.Conv2d(F1 * D, F1 * D, (1, 16), padding=(0, 8), groups=F1 * D, bias=False),
            nn.Conv2d(F1 * D, F2, 1, bias=False),
            nn.BatchNorm2d(F2),
            nn.ELU(),
            nn.AvgPool2d((1, 8)),
            nn.Dropout(dropout),
        )
        with torch.no_grad():
            n_feat = self.block2(self.block1(torch.zeros(1, 1, n_chans, n_times))).numel()
        self.classifier = nn.Linear(n_feat, n_classes)

    def forward(self, x):
        x = self.block2(self.block1(x))
        return self.classifier(x.flatten(1))


def apply_max_norm(model, max_norm=0.25):
    # max-norm constraint on the dense layer as in Lawhern et al. 2018
    with torch.no_grad():
        w = model.classifier.weight
        w.copy_(torch.renorm(w, p=2, dim=0, maxnorm=max_norm))


@torch.no_grad()
def evaluate(model, loader, device, n_classes):
    model.eval()
    confusion = torch.zeros(n_classes, n_classes, device=device, dtype=torch.long)
    loss_sum = torch.zeros(1, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(x)
        loss_sum += F.cross_entropy(logits, y, reduction="sum")
        pred = logits.argmax(1)
        confusion += torch.bincount(y * n_classes + pred, minlength=n_classes ** 2).view(n_classes, n_classes)
    dist.all_reduce(confusion)
    dist.all_reduce(loss_sum)
    n = confusion.sum().item()
    acc = confusion.diag().sum().item() / n
    p0 = acc
    pe = (confusion.sum(0) * confusion.sum(1)).sum().item() / (n * n)
    kappa = (p0 - pe) / (1 - pe)
    return loss_sum.item() / n, acc, kappa


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    seed_everything(args.seed + rank)
    is_main = rank == 0

    out_dir = Path(args.out_dir)
    if is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        with open(out_dir / "args.json", "w") as f:
            json.dump(vars(args), f, indent=2)
        writer = SummaryWriter(out_dir / "tb")

    train_ds = BCI2aTrials(args.data_dir, args.subjects, session=0, augment=True)
    test_ds = BCI2aTrials(args.data_dir, args.subjects, session=1)
    n_chans, n_times = train_ds.X.shape[1:]
    n_classes = 4

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    # every test trial exactly once: rank r takes trials r, r + world_size, ...
    test_shard = Subset(test_ds, range(rank, len(test_ds), world_size))
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_shard, batch_size=256, shuffle=False,
                             num_workers=args.num_workers, pin_memory=True)

    model = EEGNet(n_chans, n_classes, n_times, F1=args.F1, D=args.D,
                   kern_len=args.kern_len, dropout=args.dropout).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    if is_main:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"world_size={world_size} train={len(train_ds)} test={len(test_ds)} params={n_params}")

    best_kappa = -1.0
    for epoch in range(args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            apply_max_norm(model.module)
            running[0] += loss.detach() * y.size(0)
            running[1] += y.size(0)
        scheduler.step()
        dist.all_reduce(running)
        train_loss = (running[0] / running[1]).item()

        if epoch % 10 == 0 or epoch == args.epochs - 1:
            test_loss, test_acc, test_kappa = evaluate(model.module, test_loader, device, n_classes)
            if is_main:
                print(f"ep {epoch:03d} train_loss {train_loss:.4f} test_loss {test_loss:.4f} "
                      f"acc {test_acc:.4f} kappa {test_kappa:.4f} ({time.time() - t0:.1f}s)")
                writer.add_scalar("loss/train", train_loss, epoch)
                writer.add_scalar("loss/test", test_loss, epoch)
                writer.add_scalar("metrics/acc", test_acc, epoch)
                writer.add_scalar("metrics/kappa", test_kappa, epoch)
                if test_kappa > best_kappa:
                    best_kappa = test_kappa
                    torch.save({"epoch": epoch, "model": model.module.state_dict(),
                                "kappa": test_kappa, "args": vars(args)}, out_dir / "best.pt")
        if is_main:
            torch.save({"epoch": epoch, "model": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict()}, out_dir / "last.pt")

    if is_main:
        writer.close()
        print(f"best kappa {best_kappa:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
