"""Interpretable N-BEATS (trend + seasonality stacks) on the Tourism monthly competition data.

    torchrun --nproc_per_node=2 06_nbeats_interpretable_tourism.py --train data/tourism/monthly_in.csv \
        --test data/tourism/monthly_oos.csv
"""
import argparse
import csv
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

HORIZON = 24


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--test", required=True)
    ap.add_argument("--save-dir", default="ckpt/nbeats_i_tourism")
    ap.add_argument("--lookback-mult", type=int, default=2)
    ap.add_argument("--width-trend", type=int, default=256)
    ap.add_argument("--width-season", type=int, default=2048)
    ap.add_argument("--degree", type=int, default=3)
    ap.add_argument("--harmonics", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=512, help="global")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--patience", type=int, default=10)
    return ap.parse_args()


class BasisBlock(nn.Module):
    def __init__(self, lookback, width, basis_back, basis_fore):
        super().__init__()
        self.fc = nn.Sequential(
            nn.Linear(lookback, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
            nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU())
        self.theta = nn.Linear(width, basis_back.shape[0], bias=False)
        self.register_buffer("basis_back", basis_back)
        self.register_buffer("basis_fore", basis_fore)

    def forward(self, x):
        theta = self.theta(self.fc(x))
        return theta @ self.basis_back, theta @ self.basis_fore


def trend_basis(degree, lookback, horizon):
    t = torch.arange(-lookback, horizon, dtype=torch.float32) / horizon
    basis = torch.stack([t ** p for p in range(degree + 1)])
    return basis[:, :lookback], basis[:, lookback:]


def seasonality_basis(harmonics, lookback, horizon):
    t = torch.arange(-lookback, horizon, dtype=torch.float32) / horizon
    freqs = torch.arange(1, harmonics * horizon // 2 + 1, dtype=torch.float32) / harmonics
    ang = 2 * np.pi * freqs[:, None] * t[None, :]
    basis = torch.cat([torch.ones(1, len(t)), torch.cos(ang), torch.sin(ang)])
    return basis[:, :lookback], basis[:, lookback:]


class NBeatsI(nn.Module):
    def __init__(self, lookback, horizon, width_trend, width_season, degree, harmonics, blocks_per_stack=3):
        super().__init__()
        tb, tf = trend_basis(degree, lookback, horizon)
        sb, sf = seasonality_basis(harmonics, lookback, horizon)
        self.blocks = nn.ModuleList(
            [BasisBlock(lookback, width_trend, tb, tf) for _ in range(blocks_per_stack)]
            + [BasisBlock(lookback, width_season, sb, sf) for _ in range(blocks_per_stack)])

    def forward(self, x):
        residual, forecast = x, 0.0
        for block in self.blocks:
            back, fore = block(residual)
            residual = residual - back
            forecast = forecast + fore
        return forecast


class SeriesWindows(Dataset):
    def __init__(self, series, lookback, horizon, last_only=False):
        self.series, self.lookback, self.horizon = series, lookback, horizon
        self.index = []
        for i, s in enumerate(series):
            ends = [len(s)] if last_only else range(max(lookback + horizon, len(s) - 5 * horizon), len(s) + 1)
            self.index += [(i, e) for e in ends if e - horizon >= 1]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, k):
        i, end = self.index[k]
        s = self.series[i]
        x = s[max(0, end - self.horizon - self.lookback):end - self.horizon]
        x = np.pad(x, (self.lookback - len(x), 0), mode="edge")
        y = s[end - self.horizon:end]
        level = x[-self.horizon:].mean() + 1e-6
        return torch.from_numpy(x / level), torch.from_numpy(y / level), torch.tensor(level), i


def read_tourism(path):
    # columns are series, first rows are (length, start year, start month)
    raw = pd.read_csv(path)
    out = []
    for col in raw.columns:
        n = int(raw[col].iloc[0])
        out.append(raw[col].iloc[3:3 + n].to_numpy(np.float32))
    return out


def mape(pred, y):
    return 100.0 * ((pred - y).abs() / y.abs().clamp_min(1e-8)).mean(dim=1)


def run_eval(net, loader, device):
    net.eval()
    acc = torch.zeros(2, device=device)
    rows = []
    with torch.no_grad():
        for x, y, level, sid in loader:
            x, y, level = x.to(device), y.to(device), level.to(device)[:, None]
            m = mape(net(x) * level, y * level)
            acc += torch.stack([m.sum(), torch.tensor(float(len(m)), device=device)])
            rows += list(zip(sid.tolist(), m.tolist()))
    dist.all_reduce(acc)
    net.train()
    return (acc[0] / acc[1]).item(), rows


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    train_series = read_tourism(args.train)
    test_series = read_tourism(args.test)
    lookback = args.lookback_mult * HORIZON
    # validation = last horizon of the in-sample part, training windows end before it
    fit_series = [s[:-HORIZON] for s in train_series]
    train_ds = SeriesWindows(fit_series, lookback, HORIZON)
    val_ds = SeriesWindows(train_series, lookback, HORIZON, last_only=True)
    full = [np.concatenate([a, b]) for a, b in zip(train_series, test_series)]
    test_ds = SeriesWindows(full, lookback, HORIZON, last_only=True)

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size // world, sampler=sampler,
                              num_workers=2, drop_last=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=1024)
    test_loader = DataLoader(Subset(test_ds, range(rank, len(test_ds), world)), batch_size=1024)

    net = NBeatsI(lookback, HORIZON, args.width_trend, args.width_season, args.degree, args.harmonics).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    os.makedirs(args.save_dir, exist_ok=True)
    best_path = os.path.join(args.save_dir, "best.pt")

    best, wait = float("inf"), 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y, level, _ in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = (model(x) - y).abs().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()

        val_mape, _ = run_eval(net, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch:3d} loss {loss.item():.4f} val MAPE {val_mape:.3f}", flush=True)
        if val_mape < best:
            best, wait = val_mape, 0
            torch.save({"model": net.state_dict(), "epoch": epoch, "val_mape": val_mape}, best_path)
        else:
            wait += 1
            if wait >= args.patience:
                break

    dist.barrier()
    state = torch.load(best_path, map_location=device)
    net.load_state_dict(state["model"])
    test_mape, rows = run_eval(net, test_loader, device)
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        rows = sorted(r for part in gathered for r in part)
        with open(os.path.join(args.save_dir, "test_mape_per_series.csv"), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["series", "mape"])
            w.writerows(rows)
        print(f"best epoch {state['epoch']} val MAPE {best:.3f} test MAPE {test_mape:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
