#!/usr/bin/env python
"""Residual MLP on the HIGGS dataset, data-parallel across CPU nodes (gloo).

    srun --nodes=4 --ntasks-per-node=1 --cpus-per-task=32 \
        torchrun --nnodes=4 --nproc_per_node=4 --rdzv_backend=c10d \
        --rdzv_endpoint=$(scontrol show hostnames $SLURM_NODELIST | head -n1):29500 \
        --rdzv_id=$SLURM_JOB_ID 09_gloo_higgs_tabular.py --csv /shared/data/HIGGS.csv.gz
"""
import argparse
import logging
import math
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset, random_split
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("higgs")


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", required=True)
    p.add_argument("--out", default="/shared/runs/higgs_mlp")
    p.add_argument("--val-frac", type=float, default=0.05)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--lr", type=float, default=2e-3, help="max lr at a global batch of 1024")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--threads", type=int, default=8)
    return p.parse_args()


class ResBlock(nn.Module):
    def __init__(self, width, dropout):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.ff = nn.Sequential(nn.Linear(width, width * 2), nn.GELU(), nn.Dropout(dropout),
                                nn.Linear(width * 2, width))

    def forward(self, x):
        return x + self.ff(self.norm(x))


class ResMLP(nn.Module):
    def __init__(self, n_in, width, depth, dropout):
        super().__init__()
        self.inp = nn.Linear(n_in, width)
        self.blocks = nn.Sequential(*[ResBlock(width, dropout) for _ in range(depth)])
        self.out = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 1))

    def forward(self, x):
        return self.out(self.blocks(self.inp(x))).squeeze(-1)


def load_higgs(path):
    df = pd.read_csv(path, header=None, dtype=np.float32)
    y = torch.from_numpy(df.iloc[:, 0].values)
    x = torch.from_numpy(df.iloc[:, 1:].values)
    return x, y


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    s = torch.zeros(3, dtype=torch.float64)  # loss_sum, correct, n
    bce = nn.BCEWithLogitsLoss(reduction="sum")
    for x, y in loader:
        logit = model(x)
        s[0] += bce(logit, y).item()
        s[1] += ((logit > 0).float() == y).sum().item()
        s[2] += y.numel()
    dist.all_reduce(s)
    model.train()
    return s[0].item() / s[2].item(), s[1].item() / s[2].item()


def main():
    args = get_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [{rank}/{world}] %(message)s")
    # different dropout masks / init noise per worker
    torch.manual_seed(args.seed + rank)
    np.random.seed(args.seed + rank)

    t0 = time.time()
    x, y = load_higgs(args.csv)
    log.info("loaded %d rows in %.0fs", len(y), time.time() - t0)

    full = TensorDataset(x, y)
    n_val = int(len(full) * args.val_frac)
    train_set, val_set = random_split(full, [len(full) - n_val, n_val])

    # standardize with train statistics
    train_idx = torch.as_tensor(train_set.indices)
    mean = x[train_idx].mean(0)
    std = x[train_idx].std(0).clamp_min(1e-6)
    x.sub_(mean).div_(std)

    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_set, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=8192, sampler=val_sampler)

    model = DDP(ResMLP(x.shape[1], args.width, args.depth, args.dropout))
    max_lr = args.lr * math.sqrt(args.batch_size * world / 1024)  # sqrt scaling for Adam
    optimizer = torch.optim.AdamW(model.parameters(), lr=max_lr, weight_decay=1e-4)
    total_steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=max_lr, total_steps=total_steps,
                                                    pct_start=0.05)
    criterion = nn.BCEWithLogitsLoss()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    log.info("train %d val %d, %d steps/epoch, global batch %d",
             len(train_set), len(val_set), len(train_loader), args.batch_size * world)

    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        ep_start = time.time()
        running = torch.zeros(2, dtype=torch.float64)
        for step, (xb, yb) in enumerate(train_loader):
            loss = criterion(model(xb), yb)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            running += torch.tensor([loss.item() * len(yb), len(yb)], dtype=torch.float64)
        dist.all_reduce(running)

        val_loss, val_acc = evaluate(model, val_loader)
        log.info("epoch %02d train_loss %.4f val_loss %.4f val_acc %.4f (%.0fs)", epoch,
                 (running[0] / running[1]).item(), val_loss, val_acc, time.time() - ep_start)

        if rank == 0:
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch,
                     "norm_mean": mean, "norm_std": std}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if val_acc > best_acc:
                best_acc = val_acc
                torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

    log.info("best val acc %.4f", best_acc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
