"""Short-horizon mid-price classifier on LOBSTER data (NASDAQ, 10 levels).

Raw LOBSTER message/orderbook CSVs are turned into normalised feature tensors
once and cached as .npy next to the data so repeated runs start quickly.

    torchrun --nproc_per_node=8 09_lobster_feature_cache.py \
        --raw /data/lobster/AAPL_2019 --cache /data/lobster/cache --ticker AAPL
"""
import argparse
import glob
import hashlib
import json
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

LEVELS = 10


def options():
    p = argparse.ArgumentParser()
    p.add_argument("--raw", required=True)
    p.add_argument("--cache", required=True)
    p.add_argument("--ticker", required=True)
    p.add_argument("--window", type=int, default=100)
    p.add_argument("--horizon", type=int, default=20, help="events ahead")
    p.add_argument("--alpha", type=float, default=2e-5, help="stationary band on smoothed return")
    p.add_argument("--val-days", type=int, default=10)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--out", default="runs/lobster")
    return p.parse_args()


def featurize_day(book_csv, horizon, alpha):
    cols = []
    for i in range(1, LEVELS + 1):
        cols += [f"ask_p{i}", f"ask_s{i}", f"bid_p{i}", f"bid_s{i}"]
    book = pd.read_csv(book_csv, header=None, names=cols)
    ask_p = book[[f"ask_p{i}" for i in range(1, LEVELS + 1)]].to_numpy(np.float64) / 1e4
    bid_p = book[[f"bid_p{i}" for i in range(1, LEVELS + 1)]].to_numpy(np.float64) / 1e4
    ask_s = book[[f"ask_s{i}" for i in range(1, LEVELS + 1)]].to_numpy(np.float64)
    bid_s = book[[f"bid_s{i}" for i in range(1, LEVELS + 1)]].to_numpy(np.float64)
    mid = (ask_p[:, 0] + bid_p[:, 0]) / 2
    feats = np.concatenate([
        (ask_p - mid[:, None]) / mid[:, None] * 1e4,
        (mid[:, None] - bid_p) / mid[:, None] * 1e4,
        np.log1p(ask_s), np.log1p(bid_s),
        ((bid_s - ask_s) / (bid_s + ask_s + 1e-9)),
    ], axis=1).astype(np.float32)
    # label: mean of the next `horizon` mids vs current mid
    csum = np.concatenate([[0.0], np.cumsum(mid)])
    fut = (csum[horizon + 1 :] - csum[1:-horizon]) / horizon
    ret = fut / mid[: len(fut)] - 1.0
    label = np.where(ret > alpha, 2, np.where(ret < -alpha, 0, 1)).astype(np.int64)
    return feats[: len(label)], label


def cache_key(args, files):
    h = hashlib.sha1(json.dumps({"files": [os.path.basename(f) for f in files], "h": args.horizon,
                                 "a": args.alpha}).encode()).hexdigest()[:12]
    return os.path.join(args.cache, f"{args.ticker}_{h}")


def build_or_load(args, files):
    base = cache_key(args, files)
    if not os.path.exists(base + "_x.npy"):
        os.makedirs(args.cache, exist_ok=True)
        xs, ys, day_id = [], [], []
        for d, f in enumerate(files):
            x, y = featurize_day(f, args.horizon, args.alpha)
            xs.append(x)
            ys.append(y)
            day_id.append(np.full(len(y), d, dtype=np.int32))
        np.save(base + "_x.npy", np.concatenate(xs))
        np.save(base + "_y.npy", np.concatenate(ys))
        np.save(base + "_day.npy", np.concatenate(day_id))
    x = np.load(base + "_x.npy", mmap_mode="r")
    y = np.load(base + "_y.npy")
    day = np.load(base + "_day.npy")
    return x, y, day


class EventWindows(Dataset):
    def __init__(self, x, y, day, days, window):
        self.x, self.y, self.window = x, y, window
        ok = np.isin(day, days)
        # a window must not straddle two trading days
        starts = np.flatnonzero(ok)
        same_day = day[np.clip(starts - window + 1, 0, None)] == day[starts]
        self.ends = starts[(starts >= window - 1) & same_day]

    def __len__(self):
        return len(self.ends)

    def __getitem__(self, i):
        e = self.ends[i]
        return torch.from_numpy(np.array(self.x[e - self.window + 1 : e + 1])), int(self.y[e])


class ConvGRU(nn.Module):
    def __init__(self, n_feat, hidden=96):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv1d(n_feat, hidden, 5, padding=2), nn.GELU(),
            nn.Conv1d(hidden, hidden, 5, padding=2), nn.GELU(),
        )
        self.gru = nn.GRU(hidden, hidden, batch_first=True)
        self.out = nn.Linear(hidden, 3)

    def forward(self, x):
        h = self.conv(x.transpose(1, 2)).transpose(1, 2)
        h, _ = self.gru(h)
        return self.out(h[:, -1])


def main():
    args = options()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    files = sorted(glob.glob(os.path.join(args.raw, f"{args.ticker}_*_orderbook_{LEVELS}.csv")))
    x, y, day = build_or_load(args, files)
    n_days = len(files)
    train_days = np.arange(0, n_days - args.val_days)
    val_days = np.arange(n_days - args.val_days, n_days)
    train_ds = EventWindows(x, y, day, train_days, args.window)
    val_ds = EventWindows(x, y, day, val_days, args.window)

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, 1024, sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True), num_workers=2)

    counts = np.bincount(y[train_ds.ends], minlength=3).astype(np.float32)
    class_w = torch.tensor(counts.sum() / (3 * counts), device=dev)
    model = DDP(ConvGRU(x.shape[1]).to(dev), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"days={n_days} train={len(train_ds)} val={len(val_ds)} class_counts={counts.tolist()}", flush=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for xb, yb in train_dl:
            xb, yb = xb.to(dev, non_blocking=True), yb.to(dev, non_blocking=True)
            loss = F.cross_entropy(model(xb), yb, weight=class_w)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        model.eval()
        conf = torch.zeros(9, device=dev)
        with torch.no_grad():
            for xb, yb in val_dl:
                xb, yb = xb.to(dev), yb.to(dev)
                conf += torch.bincount(yb * 3 + model(xb).argmax(1), minlength=9).float()
        dist.all_reduce(conf)
        conf = conf.view(3, 3)
        recall = (conf.diag() / conf.sum(1).clamp(min=1)).tolist()
        if rank == 0:
            print(f"epoch {epoch} acc {(conf.diag().sum() / conf.sum()).item():.4f} "
                  f"recall down/flat/up {recall[0]:.3f}/{recall[1]:.3f}/{recall[2]:.3f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save(model.module.state_dict(), os.path.join(args.out, f"convgru_e{epoch:02d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
