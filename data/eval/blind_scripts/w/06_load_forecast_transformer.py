"""
Electricity load forecasting with a small Transformer encoder (multi-GPU, DDP).

Input: hourly load CSV with a `timestamp` column and one column per meter.
Predicts the next 24 h from the previous 168 h (one week).

Start:
    torchrun --nproc_per_node=4 06_load_forecast_transformer.py --csv data/LD2011_2014_hourly.csv
Resume after a crash / preemption:
    torchrun --nproc_per_node=4 06_load_forecast_transformer.py --csv ... --resume ckpt/last.pt
"""
import argparse
import math
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", required=True)
    p.add_argument("--lookback", type=int, default=168)
    p.add_argument("--horizon", type=int, default=24)
    p.add_argument("--d_model", type=int, default=128)
    p.add_argument("--nhead", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch_size", type=int, default=256)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--ckpt_dir", default="ckpt")
    p.add_argument("--resume", default=None)
    return p.parse_args()


class WindowDataset(Dataset):
    """Sliding windows over every meter; series are z-normalised with train statistics."""

    def __init__(self, values, lookback, horizon):
        self.values = values  # (T, n_series), float32
        self.lookback, self.horizon = lookback, horizon
        self.per_series = values.shape[0] - lookback - horizon + 1
        self.n_series = values.shape[1]

    def __len__(self):
        return self.per_series * self.n_series

    def __getitem__(self, idx):
        s, t = divmod(idx, self.per_series)
        x = self.values[t: t + self.lookback, s]
        y = self.values[t + self.lookback: t + self.lookback + self.horizon, s]
        return torch.from_numpy(x).unsqueeze(-1), torch.from_numpy(y)


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, max_len=2048):
        super().__init__()
        pe = torch.zeros(max_len, d_model)
        pos = torch.arange(max_len).unsqueeze(1)
        div = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(pos * div)
        pe[:, 1::2] = torch.cos(pos * div)
        self.register_buffer("pe", pe.unsqueeze(0), persistent=False)

    def forward(self, x):
        return x + self.pe[:, : x.size(1)]


class Forecaster(nn.Module):
    def __init__(self, d_model, nhead, layers, horizon, lookback):
        super().__init__()
        self.inp = nn.Linear(1, d_model)
        self.pos = PositionalEncoding(d_model)
        layer = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward=4 * d_model,
                                           dropout=0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(lookback * d_model, horizon))

    def forward(self, x):
        h = self.pos(self.inp(x))
        h = self.encoder(h)
        return self.head(h)


def load_series(csv, lookback, horizon):
    df = pd.read_csv(csv, parse_dates=["timestamp"]).set_index("timestamp").sort_index()
    df = df.loc[:, df.std() > 0].fillna(0.0)
    values = df.values.astype(np.float32)
    n = len(values)
    train_end = int(n * 0.8)
    mean, std = values[:train_end].mean(0), values[:train_end].std(0) + 1e-6
    values = (values - mean) / std
    train = WindowDataset(values[:train_end], lookback, horizon)
    val = WindowDataset(values[train_end - lookback:], lookback, horizon)
    return train, val


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds, val_ds = load_series(args.csv, args.lookback, args.horizon)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                              num_workers=4, pin_memory=True, persistent_workers=True)
    # plain strided split for validation (no padding -> exact metrics after all_reduce)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world_size)),
                            batch_size=1024, num_workers=4, pin_memory=True)

    model = Forecaster(args.d_model, args.nhead, args.layers, args.horizon, args.lookback).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs, eta_min=1e-6)

    start_epoch, best_val = 0, float("inf")
    if args.resume:
        checkpoint = torch.load(args.resume)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        start_epoch = checkpoint["epoch"] + 1
        best_val = checkpoint["best_val"]
        if rank == 0:
            print(f"Resuming from epoch {start_epoch} (best val mse so far {best_val:.4f})")

    model = DDP(model, device_ids=[local_rank])
    criterion = nn.MSELoss()

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"{len(train_ds)} train windows | {len(val_ds)} val windows | {n_params / 1e6:.2f}M params")

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tr = torch.zeros(2, device=device)
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            pred = model(x)
            loss = criterion(pred, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            tr += torch.stack([loss.detach() * x.size(0), torch.tensor(float(x.size(0)), device=device)])
            if rank == 0 and i % 200 == 0:
                print(f"  ep {epoch} it {i}/{len(train_loader)} loss {loss.item():.4f}")
        scheduler.step()

        model.eval()
        va = torch.zeros(3, device=device)  # sse, sae, count
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                pred = model.module(x)
                va[0] += ((pred - y) ** 2).sum()
                va[1] += (pred - y).abs().sum()
                va[2] += y.numel()
        dist.all_reduce(tr)
        dist.all_reduce(va)
        train_mse = (tr[0] / tr[1]).item()
        val_mse, val_mae = (va[0] / va[2]).item(), (va[1] / va[2]).item()

        is_best = val_mse < best_val
        best_val = min(best_val, val_mse)
        if rank == 0:
            print(f"epoch {epoch:3d} | train mse {train_mse:.4f} | val mse {val_mse:.4f} "
                  f"mae {val_mae:.4f} | {time.time() - t0:.0f}s")
            ckpt = {
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "epoch": epoch,
                "best_val": best_val,
                "args": vars(args),
            }
            torch.save(ckpt, os.path.join(args.ckpt_dir, "last.pt"))
            if is_best:
                torch.save(ckpt, os.path.join(args.ckpt_dir, "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
