"""Spatio-temporal GRU for traffic speed forecasting (METR-LA / PEMS-BAY).

Launch:
    torchrun --nproc_per_node=4 01_traffic_stgru.py --data data/metr-la.h5 --adj data/adj_mx.pkl
"""
import argparse
import os
import pickle
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data/metr-la.h5")
    p.add_argument("--adj", default="data/adj_mx.pkl")
    p.add_argument("--in-steps", type=int, default=12)
    p.add_argument("--out-steps", type=int, default=12)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--clip", type=float, default=5.0)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--out-dir", default="runs/stgru")
    p.add_argument("--wandb-project", default="traffic-forecast")
    return p.parse_args()


class SlidingWindow(Dataset):
    """Windows of (in_steps -> out_steps) over a [T, N, C] array."""

    def __init__(self, data, in_steps, out_steps):
        self.data = torch.from_numpy(data).float()
        self.in_steps = in_steps
        self.out_steps = out_steps
        self.n = data.shape[0] - in_steps - out_steps + 1

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x = self.data[i:i + self.in_steps]
        y = self.data[i + self.in_steps:i + self.in_steps + self.out_steps, :, 0]
        return x, y


def load_series(path):
    df = pd.read_hdf(path)
    speed = df.values.astype(np.float32)
    # time-of-day as a second channel, as in DCRNN
    tod = (df.index.values - df.index.values.astype("datetime64[D]")) / np.timedelta64(1, "D")
    tod = np.tile(tod[:, None], (1, speed.shape[1])).astype(np.float32)
    return np.stack([speed, tod], axis=-1)


def normalised_adjacency(path):
    with open(path, "rb") as f:
        _, _, adj = pickle.load(f, encoding="latin1")
    adj = torch.tensor(adj, dtype=torch.float32)
    adj = adj + torch.eye(adj.size(0))
    d = adj.sum(1).pow(-0.5)
    return d[:, None] * adj * d[None, :]


class GraphGRUCell(nn.Module):
    def __init__(self, in_dim, hidden):
        super().__init__()
        self.gates = nn.Linear(in_dim + hidden, 2 * hidden)
        self.cand = nn.Linear(in_dim + hidden, hidden)

    def forward(self, x, h, adj):
        xh = torch.cat([x, h], dim=-1)
        xh = torch.einsum("nm,bmc->bnc", adj, xh)
        r, u = torch.sigmoid(self.gates(xh)).chunk(2, dim=-1)
        c = torch.cat([x, r * h], dim=-1)
        c = torch.tanh(self.cand(torch.einsum("nm,bmc->bnc", adj, c)))
        return u * h + (1 - u) * c


class STGRU(nn.Module):
    def __init__(self, adj, in_dim, hidden, out_steps):
        super().__init__()
        self.register_buffer("adj", adj)
        self.cell1 = GraphGRUCell(in_dim, hidden)
        self.cell2 = GraphGRUCell(hidden, hidden)
        self.head = nn.Linear(hidden, out_steps)
        self.hidden = hidden

    def forward(self, x):
        b, t, n, _ = x.shape
        h1 = x.new_zeros(b, n, self.hidden)
        h2 = x.new_zeros(b, n, self.hidden)
        for s in range(t):
            h1 = self.cell1(x[:, s], h1, self.adj)
            h2 = self.cell2(h1, h2, self.adj)
        return self.head(h2).permute(0, 2, 1)  # [B, out_steps, N]


def masked_mae(pred, target, min_val=1e-3):
    mask = (target > min_val).float()
    mask = mask / mask.mean().clamp_min(1e-6)
    loss = (pred - target).abs() * mask
    return torch.nan_to_num(loss).mean()


@torch.no_grad()
def evaluate(model, loader, mean, std, device):
    model.eval()
    sums = torch.zeros(3, device=device)  # abs err, sq err, count
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        pred = model(x) * std + mean
        y = y * std + mean
        mask = y > 1e-3
        sums[0] += (pred - y).abs()[mask].sum()
        sums[1] += ((pred - y) ** 2)[mask].sum()
        sums[2] += mask.sum()
    dist.all_reduce(sums)
    mae = (sums[0] / sums[2]).item()
    rmse = (sums[1] / sums[2]).sqrt().item()
    return mae, rmse


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    wandb.init(project=args.wandb_project, config=vars(args), name=f"stgru-{args.hidden}")

    series = load_series(args.data)
    n_t = series.shape[0]
    n_train, n_val = int(0.7 * n_t), int(0.1 * n_t)
    train_raw = series[:n_train]
    mean = float(train_raw[..., 0].mean())
    std = float(train_raw[..., 0].std())
    norm = series.copy()
    norm[..., 0] = (norm[..., 0] - mean) / std

    train_ds = SlidingWindow(norm[:n_train], args.in_steps, args.out_steps)
    val_ds = SlidingWindow(norm[n_train - args.in_steps:n_train + n_val], args.in_steps, args.out_steps)

    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    adj = normalised_adjacency(args.adj)
    model = STGRU(adj, in_dim=series.shape[-1], hidden=args.hidden, out_steps=args.out_steps).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[20, 30, 40, 50], gamma=0.1)

    os.makedirs(args.out_dir, exist_ok=True)
    best_mae = float("inf")
    step = 0
    for epoch in range(args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            pred = model(x) * std + mean
            loss = masked_mae(pred, y * std + mean)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            running[0] += loss.detach()
            running[1] += 1
            step += 1
        sched.step()
        dist.all_reduce(running)
        train_mae = (running[0] / running[1]).item()

        val_mae, val_rmse = evaluate(model, val_loader, mean, std, device)
        if rank == 0:
            wandb.log({"train/mae": train_mae, "val/mae": val_mae, "val/rmse": val_rmse,
                       "lr": opt.param_groups[0]["lr"], "epoch": epoch,
                       "epoch_time": time.time() - t0}, step=step)
            print(f"epoch {epoch:3d} train_mae {train_mae:.3f} val_mae {val_mae:.3f} "
                  f"val_rmse {val_rmse:.3f} ({time.time() - t0:.1f}s)", flush=True)
            if val_mae < best_mae:
                best_mae = val_mae
                torch.save({"model": model.module.state_dict(), "epoch": epoch,
                            "mean": mean, "std": std, "val_mae": val_mae},
                           os.path.join(args.out_dir, "best.pt"))
        dist.barrier()

    if rank == 0:
        wandb.summary["best_val_mae"] = best_mae
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
