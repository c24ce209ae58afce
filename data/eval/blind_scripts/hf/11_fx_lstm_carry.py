#!/usr/bin/env python
"""LSTM allocator for a G10 FX basket.

Reads hourly spot, forward points and rate differentials for the G10 crosses,
outputs target weights, and is trained end-to-end on a differentiable Sharpe
objective net of proportional transaction costs.

Usage:
    torchrun --nproc_per_node=4 11_fx_lstm_carry.py --data /data/fx/g10_hourly.h5 --epochs 60
"""
import argparse
import math
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

PAIRS = ["EURUSD", "GBPUSD", "USDJPY", "AUDUSD", "NZDUSD", "USDCAD", "USDCHF", "USDNOK", "USDSEK"]
HOURS_PER_YEAR = 24 * 260


def get_parser():
    parser = argparse.ArgumentParser(description="FX LSTM allocator")
    parser.add_argument("--data", type=str, required=True)
    parser.add_argument("--seq-len", type=int, default=168)
    parser.add_argument("--hold", type=int, default=24, help="hours the weights are held")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--cost-bps", type=float, default=0.5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--valid-start", type=str, default="2021-01-01")
    parser.add_argument("--out", type=str, default="models/fx_lstm")
    parser.add_argument("--local_rank", type=int, default=0)
    return parser


class FXSequences(Dataset):
    def __init__(self, feats, rets, seq_len, hold, lo, hi):
        self.feats, self.rets = feats, rets
        self.seq_len, self.hold = seq_len, hold
        self.starts = np.arange(max(lo, seq_len), hi - hold, hold // 2)

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        t = self.starts[i]
        x = torch.from_numpy(self.feats[t - self.seq_len : t])
        fwd = torch.from_numpy(self.rets[t : t + self.hold])  # (hold, n_pairs) realised returns incl. carry
        return x, fwd


class Allocator(nn.Module):
    def __init__(self, n_in, n_assets, hidden, layers):
        super().__init__()
        self.lstm = nn.LSTM(n_in, hidden, num_layers=layers, batch_first=True, dropout=0.1)
        self.out = nn.Linear(hidden, n_assets)

    def forward(self, x):
        h, _ = self.lstm(x)
        w = torch.tanh(self.out(h[:, -1]))
        return w / w.abs().sum(-1, keepdim=True).clamp(min=1.0)  # gross leverage <= 1


def portfolio_pnl(weights, fwd, cost_bps):
    pnl = (weights.unsqueeze(1) * fwd).sum(-1).sum(-1)  # (B,)
    turnover = weights.abs().sum(-1)  # enter from flat / exit each holding period
    return pnl - 2 * turnover * cost_bps * 1e-4


def sharpe_loss(pnl, hold):
    ann = math.sqrt(HOURS_PER_YEAR / hold)
    return -ann * pnl.mean() / (pnl.std() + 1e-8)


def load(path):
    with h5py.File(path, "r") as f:
        times = f["time"][:].astype("datetime64[s]")
        spot = f["log_spot"][:]
        fwdpts = f["carry"][:]
        rdiff = f["rate_diff"][:]
    rets = np.diff(spot, axis=0, prepend=spot[:1]) + fwdpts
    # features: hourly returns, 24h/120h momentum, carry, rate differentials - all vol-scaled
    vol = np.sqrt(np.nan_to_num(np.cumsum(rets ** 2, 0) / (np.arange(len(rets))[:, None] + 1)))
    mom24 = np.nan_to_num((np.cumsum(rets, 0) - np.roll(np.cumsum(rets, 0), 24, 0)) / (vol * np.sqrt(24) + 1e-8))
    mom120 = np.nan_to_num((np.cumsum(rets, 0) - np.roll(np.cumsum(rets, 0), 120, 0)) / (vol * np.sqrt(120) + 1e-8))
    feats = np.concatenate([rets / (vol + 1e-8), mom24, mom120, fwdpts / (vol + 1e-8), rdiff], axis=1)
    return times, np.clip(feats, -10, 10).astype(np.float32), rets.astype(np.float32)


def main():
    args = get_parser().parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    times, feats, rets = load(args.data)
    split = int(np.searchsorted(times, np.datetime64(args.valid_start)))
    train_ds = FXSequences(feats, rets, args.seq_len, args.hold, 0, split)
    valid_ds = FXSequences(feats, rets, args.seq_len, args.hold, split, len(times))

    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=2,
                              pin_memory=True, drop_last=True)

    model = Allocator(feats.shape[1], len(PAIRS), args.hidden, args.layers).to(device)
    model = DDP(model, device_ids=[args.local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.3)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"train seqs {len(train_ds)}, valid seqs {len(valid_ds)}, world {world_size}", flush=True)

    best_sharpe = -float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for x, fwd in train_loader:
            x, fwd = x.to(device, non_blocking=True), fwd.to(device, non_blocking=True)
            pnl = portfolio_pnl(model(x), fwd, args.cost_bps)
            loss = sharpe_loss(pnl, args.hold)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(loss_sum)

        # backtest the validation period in order on rank 0 (non-overlapping holding periods)
        if rank == 0:
            net = model.module.eval()
            with torch.no_grad():
                idx = np.arange(0, len(valid_ds), 2)
                xs = torch.stack([valid_ds[i][0] for i in idx]).to(device)
                fw = torch.stack([valid_ds[i][1] for i in idx]).to(device)
                pnl = portfolio_pnl(net(xs), fw, args.cost_bps).cpu().numpy()
            sharpe = pnl.mean() / (pnl.std() + 1e-12) * math.sqrt(HOURS_PER_YEAR / args.hold)
            print(f"epoch {epoch:3d} train_loss {(loss_sum[0] / loss_sum[1]).item():+.3f} "
                  f"valid_sharpe {sharpe:+.2f} cum_pnl {pnl.sum():+.4f} ({time.time() - t0:.1f}s)", flush=True)
            if sharpe > best_sharpe:
                best_sharpe = sharpe
                torch.save({"model": net.state_dict(), "epoch": epoch, "sharpe": float(sharpe), "pairs": PAIRS},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
