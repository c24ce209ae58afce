"""Residual mean-reversion (stat-arb) signal learned with a small CNN + attention
over the last 30 days of PCA residual returns, followed by a daily backtest of
the validation period. Each rank backtests its own block of days and the PnL
statistics are combined at the end.

    torchrun --nproc_per_node=4 14_statarb_backtest_reduce.py --residuals /data/statarb/resid_pca15.npz
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--residuals", required=True)
    p.add_argument("--lookback", type=int, default=30)
    p.add_argument("--train-frac", type=float, default=0.7)
    p.add_argument("--channels", type=int, default=8)
    p.add_argument("--d-model", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--cost-bps", type=float, default=5.0)
    p.add_argument("--out", default="runs/statarb_cnn")
    return p.parse_args()


class ResidualWindows(Dataset):
    """resid: (T, N) daily residual returns, valid: (T, N) bool tradeable mask."""

    def __init__(self, resid, valid, lookback, days):
        self.resid, self.lookback = resid, lookback
        self.items = [(t, n) for t in days for n in np.flatnonzero(valid[t])]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        t, n = self.items[i]
        window = self.resid[t - self.lookback : t, n]
        cum = np.cumsum(window).astype(np.float32)  # residual "price" path
        return torch.from_numpy(cum).unsqueeze(0), torch.tensor(self.resid[t, n], dtype=torch.float32)


class CNNTransformer(nn.Module):
    def __init__(self, channels, d_model, lookback):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv1d(1, channels, 2, padding=1), nn.ReLU(), nn.Conv1d(channels, d_model, 2), nn.ReLU())
        layer = nn.TransformerEncoderLayer(d_model, 4, 4 * d_model, 0.25, batch_first=True)
        self.attn = nn.TransformerEncoder(layer, 1)
        self.out = nn.Linear(d_model * lookback, 1)

    def forward(self, x):
        x = x - x[:, :, -1:]  # path relative to today
        h = self.conv(x).transpose(1, 2)
        h = self.attn(h)
        return self.out(h.flatten(1)).squeeze(-1)


def sharpe_objective(signal, ret):
    # per-batch long-short portfolio: weights proportional to signal, gross 1
    w = signal - signal.mean()
    w = w / (w.abs().sum() + 1e-8)
    pnl = (w * ret).sum()
    return pnl, w


def daily_backtest(model, resid, valid, lookback, days, cost_bps, device):
    model.eval()
    pnl, turnover = [], []
    prev_w = np.zeros(resid.shape[1])
    with torch.no_grad():
        for t in days:
            names = np.flatnonzero(valid[t])
            if len(names) < 20:
                pnl.append(0.0)
                turnover.append(0.0)
                continue
            x = np.cumsum(resid[t - lookback : t, names], axis=0).T.astype(np.float32)
            sig = model(torch.from_numpy(x).unsqueeze(1).to(device)).cpu().numpy()
            w = np.zeros(resid.shape[1])
            w[names] = sig - sig.mean()
            w /= np.abs(w).sum() + 1e-12
            tc = np.abs(w - prev_w).sum() * cost_bps * 1e-4
            pnl.append(float((w[names] * resid[t, names]).sum() - tc))
            turnover.append(float(np.abs(w - prev_w).sum()))
            prev_w = w
    return np.array(pnl), np.array(turnover)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    z = np.load(args.residuals)
    resid, valid = z["resid"].astype(np.float64), z["valid"].astype(bool)
    T = resid.shape[0]
    split = int(T * args.train_frac)
    train_days = np.arange(args.lookback, split)
    test_days = np.arange(split, T)

    train_ds = ResidualWindows(resid, valid, args.lookback, train_days)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)

    model = DDP(CNNTransformer(args.channels, args.d_model, args.lookback).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"days={T} train samples={len(train_ds)} world={world}", flush=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        stats = torch.zeros(2, device=device)
        for x, r in loader:
            x, r = x.to(device, non_blocking=True), r.to(device, non_blocking=True)
            pnl, _ = sharpe_objective(model(x), r)
            loss = -pnl * 100
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            stats += torch.stack([pnl.detach(), torch.ones((), device=device)])
        dist.all_reduce(stats)
        if rank == 0:
            print(f"epoch {epoch} mean batch pnl {(stats[0] / stats[1]).item() * 1e4:.2f} bps ({time.time() - t0:.0f}s)",
                  flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(args.out, "last.pt"))
        dist.barrier()

    # out-of-sample backtest: contiguous block of test days per rank
    my_days = np.array_split(test_days, world)[rank]
    pnl, turnover = daily_backtest(model.module, resid, valid, args.lookback, my_days, args.cost_bps, device)
    totals = torch.tensor([pnl.sum(), (pnl ** 2).sum(), float(len(pnl)), turnover.sum()], dtype=torch.float64)
    dist.all_reduce(totals)
    s, ss, n, to = totals.tolist()
    mean = s / n
    std = math.sqrt(max(ss / n - mean ** 2, 1e-18))
    if rank == 0:
        print(f"OOS days={int(n)} ann.return={mean * 252:.2%} ann.vol={std * math.sqrt(252):.2%} "
              f"sharpe={mean / std * math.sqrt(252):.2f} avg turnover={to / n:.2f}")
        np.save(os.path.join(args.out, "oos_pnl_rank0.npy"), pnl)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
