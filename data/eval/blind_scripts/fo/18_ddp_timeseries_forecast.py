"""Long-horizon multivariate forecasting (PatchTST-style transformer) on electricity /
traffic data. DDP, bf16 autocast, gradient accumulation, activation checkpointing.

    torchrun --nproc_per_node=4 18_ddp_timeseries_forecast.py --csv data/electricity.csv --pred_len 336
"""
import argparse
import contextlib
import math
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def build_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", required=True)
    p.add_argument("--seq_len", type=int, default=512)
    p.add_argument("--pred_len", type=int, default=96)
    p.add_argument("--patch", type=int, default=16)
    p.add_argument("--stride", type=int, default=8)
    p.add_argument("--d_model", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--patience", type=int, default=8)
    p.add_argument("--ckpt", default="checkpoints/patchtst.pt")
    p.add_argument("--local_rank", type=int, default=0)
    return p


class Windows(Dataset):
    def __init__(self, values, seq_len, pred_len):
        self.v = torch.from_numpy(values.astype(np.float32))
        self.seq_len, self.pred_len = seq_len, pred_len

    def __len__(self):
        return len(self.v) - self.seq_len - self.pred_len + 1

    def __getitem__(self, i):
        x = self.v[i : i + self.seq_len]
        y = self.v[i + self.seq_len : i + self.seq_len + self.pred_len]
        return x, y


class PatchTST(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.patch, self.stride = a.patch, a.stride
        n_patches = (a.seq_len - a.patch) // a.stride + 1
        self.embed = nn.Linear(a.patch, a.d_model)
        self.pos = nn.Parameter(torch.randn(1, n_patches, a.d_model) * 0.02)
        self.layers = nn.ModuleList([
            nn.TransformerEncoderLayer(a.d_model, 8, 4 * a.d_model, dropout=0.2, batch_first=True, norm_first=True)
            for _ in range(a.layers)
        ])
        self.head = nn.Linear(n_patches * a.d_model, a.pred_len)

    def forward(self, x):  # x: [B, L, C]
        mean = x.mean(1, keepdim=True)
        std = x.std(1, keepdim=True) + 1e-5
        x = ((x - mean) / std).permute(0, 2, 1)  # [B, C, L]
        B, C, L = x.shape
        z = x.unfold(-1, self.patch, self.stride).reshape(B * C, -1, self.patch)
        z = self.embed(z) + self.pos
        for layer in self.layers:
            if self.training:
                z = checkpoint(layer, z, use_reentrant=False)
            else:
                z = layer(z)
        out = self.head(z.flatten(1)).view(B, C, -1).permute(0, 2, 1)
        return out * std + mean


def load_splits(path, seq_len):
    df = pd.read_csv(path)
    values = df.drop(columns=["date"]).values
    n = len(values)
    n_train, n_val = int(n * 0.7), int(n * 0.1)
    train, val = values[:n_train], values[n_train - seq_len : n_train + n_val]
    mu, sigma = train.mean(0), train.std(0) + 1e-8
    return (train - mu) / sigma, (val - mu) / sigma


def main():
    args = build_parser().parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    torch.manual_seed(2021)

    train_vals, val_vals = load_splits(args.csv, args.seq_len)
    train_ds = Windows(train_vals, args.seq_len, args.pred_len)
    val_ds = Windows(val_vals, args.seq_len, args.pred_len)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=128, num_workers=2)

    model = PatchTST(args).to(device)
    model = DDP(model, device_ids=[args.local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, pct_start=0.3,
                                                total_steps=args.epochs * (len(train_loader) // args.accum))
    mse = nn.MSELoss()

    best, bad_epochs = math.inf, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        n_steps = (len(train_loader) // args.accum) * args.accum
        for i, (x, y) in enumerate(train_loader):
            if i >= n_steps:
                break
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            step_now = (i + 1) % args.accum == 0
            with contextlib.nullcontext() if step_now else model.no_sync():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    pred = model(x)
                loss = mse(pred.float(), y)
                (loss / args.accum).backward()
            if step_now:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                sched.step()

        model.eval()
        tot = torch.zeros(3, device=device, dtype=torch.float64)
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device), y.to(device)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    pred = model.module(x).float()
                tot[0] += ((pred - y) ** 2).sum()
                tot[1] += (pred - y).abs().sum()
                tot[2] += y.numel()
        dist.all_reduce(tot)
        val_mse, val_mae = (tot[0] / tot[2]).item(), (tot[1] / tot[2]).item()
        if rank == 0:
            print(f"epoch {epoch} train_loss {loss.item():.4f} val_mse {val_mse:.4f} val_mae {val_mae:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)

        # identical decision on every rank: val metrics are all-reduced
        if val_mse < best:
            best, bad_epochs = val_mse, 0
            if rank == 0:
                os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "val_mse": val_mse}, args.ckpt)
        else:
            bad_epochs += 1
            if bad_epochs >= args.patience:
                if rank == 0:
                    print(f"early stopping at epoch {epoch}, best val_mse {best:.4f}")
                break
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
