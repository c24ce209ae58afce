"""N-BEATS (generic) on M4 with DDP.

Usage:
    torchrun --standalone --nproc_per_node=4 03_nbeats_m4.py --freq Daily --horizon 14
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, Sampler


def get_args():
    ap = argparse.ArgumentParser("nbeats-m4")
    ap.add_argument("--root", default="/mnt/datasets/m4")
    ap.add_argument("--freq", default="Daily")
    ap.add_argument("--horizon", type=int, default=14)
    ap.add_argument("--lookback_mult", type=int, default=5)
    ap.add_argument("--history_limit", type=int, default=200,
                    help="only sample window ends from the last N*horizon points")
    ap.add_argument("--stacks", type=int, default=30)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--windows_per_series", type=int, default=8)
    ap.add_argument("--save", default="out/nbeats_m4")
    return ap.parse_args()


def read_m4(root, freq):
    def load(split):
        df = pd.read_csv(os.path.join(root, f"{split}", f"{freq}-{split}.csv"), index_col=0)
        return [row.dropna().to_numpy(np.float32) for _, row in df.iterrows()]
    return load("train"), load("test")


class M4Windows(Dataset):
    """Random windows drawn per series; one epoch = windows_per_series draws per series."""

    def __init__(self, series, lookback, horizon, history_limit, windows_per_series):
        self.series = series
        self.L, self.H = lookback, horizon
        self.limit = history_limit
        self.k = windows_per_series

    def __len__(self):
        return len(self.series) * self.k

    def __getitem__(self, i):
        ts = self.series[i // self.k]
        lo = max(1, len(ts) - self.limit * self.H)
        cut = np.random.randint(lo, len(ts))
        x = np.zeros(self.L, np.float32)
        xm = np.zeros(self.L, np.float32)
        past = ts[max(0, cut - self.L):cut]
        x[-len(past):] = past
        xm[-len(past):] = 1.0
        y = np.zeros(self.H, np.float32)
        ym = np.zeros(self.H, np.float32)
        fut = ts[cut:cut + self.H]
        y[:len(fut)] = fut
        ym[:len(fut)] = 1.0
        return x, xm, y, ym


class LastWindow(Dataset):
    """Last lookback of each series, target = the following horizon points."""

    def __init__(self, history, targets, lookback):
        self.h, self.t, self.L = history, targets, lookback

    def __len__(self):
        return len(self.h)

    def __getitem__(self, i):
        ts = self.h[i][-self.L:]
        x = np.zeros(self.L, np.float32)
        xm = np.zeros(self.L, np.float32)
        x[-len(ts):] = ts
        xm[-len(ts):] = 1.0
        return x, xm, self.t[i].astype(np.float32), np.ones_like(self.t[i], dtype=np.float32)


class EvalShardSampler(Sampler):
    """Contiguous, unpadded shard of an eval set (every series scored exactly once)."""

    def __init__(self, n, rank, world):
        per = (n + world - 1) // world
        self.idx = list(range(rank * per, min(n, (rank + 1) * per)))

    def __iter__(self):
        return iter(self.idx)

    def __len__(self):
        return len(self.idx)


class Block(nn.Module):
    def __init__(self, L, H, width, layers):
        super().__init__()
        mods, d = [], L
        for _ in range(layers):
            mods += [nn.Linear(d, width), nn.ReLU()]
            d = width
        self.fc = nn.Sequential(*mods)
        self.theta = nn.Linear(width, L + H)
        self.L = L

    def forward(self, x):
        t = self.theta(self.fc(x))
        return t[:, :self.L], t[:, self.L:]


class NBeats(nn.Module):
    def __init__(self, L, H, stacks, layers, width):
        super().__init__()
        self.blocks = nn.ModuleList([Block(L, H, width, layers) for _ in range(stacks)])

    def forward(self, x, mask):
        residual = x.flip(1)
        m = mask.flip(1)
        forecast = x[:, -1:]
        for b in self.blocks:
            back, f = b(residual)
            residual = (residual - back) * m
            forecast = forecast + f
        return forecast


def smape_loss(pred, y, mask):
    den = pred.abs() + y.abs()
    r = torch.where(den > 0, 2 * (pred - y).abs() / den, torch.zeros_like(den))
    return (r * mask).sum() / mask.sum().clamp(min=1)


@torch.no_grad()
def evaluate(model, loader, dev):
    model.eval()
    tot = torch.zeros(2, device=dev, dtype=torch.float64)
    for x, xm, y, ym in loader:
        x, xm, y, ym = (t.to(dev) for t in (x, xm, y, ym))
        p = model(x, xm)
        den = p.abs() + y.abs()
        s = torch.where(den > 0, 200 * (p - y).abs() / den, torch.zeros_like(den))
        tot[0] += (s * ym).sum()
        tot[1] += ym.sum()
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    lr_ = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(lr_)
    dev = torch.device("cuda", lr_)
    torch.manual_seed(0)

    train_series, test_targets = read_m4(args.root, args.freq)
    H = args.horizon
    L = args.lookback_mult * H
    # validation = last horizon of every training series
    fit_series = [s[:-H] for s in train_series if len(s) > 2 * H]
    val_hist = [s[:-H] for s in train_series if len(s) > 2 * H]
    val_tgt = [s[-H:] for s in train_series if len(s) > 2 * H]

    train_ds = M4Windows(fit_series, L, H, args.history_limit, args.windows_per_series)
    val_ds = LastWindow(val_hist, val_tgt, L)
    test_ds = LastWindow(train_series, test_targets, L)

    train_dl = DataLoader(train_ds, batch_size=args.batch, shuffle=True, num_workers=8,
                          pin_memory=True, drop_last=True,
                          worker_init_fn=lambda w: np.random.seed(torch.initial_seed() % 2**32))
    val_dl = DataLoader(val_ds, batch_size=2048, num_workers=4,
                        sampler=EvalShardSampler(len(val_ds), rank, world))
    test_dl = DataLoader(test_ds, batch_size=2048, num_workers=4,
                         sampler=EvalShardSampler(len(test_ds), rank, world))

    net = NBeats(L, H, args.stacks, args.layers, args.width).to(dev)
    net = DistributedDataParallel(net, device_ids=[lr_])
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=max(1, args.epochs // 3), gamma=0.5)

    os.makedirs(args.save, exist_ok=True)
    best = float("inf")
    for ep in range(args.epochs):
        t0 = time.time()
        loss_sum = torch.zeros((), device=dev)
        for step, (x, xm, y, ym) in enumerate(train_dl):
            x, xm, y, ym = (t.to(dev, non_blocking=True) for t in (x, xm, y, ym))
            loss = smape_loss(net(x, xm), y, ym)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            loss_sum += loss.detach()
        sched.step()
        dist.all_reduce(loss_sum)
        val = evaluate(net, val_dl, dev)
        if rank == 0:
            print(f"[{ep:03d}] train_smape={loss_sum.item() / world / (step + 1):.4f} "
                  f"val_smape={val:.3f} ({time.time() - t0:.1f}s)", flush=True)
            if val < best:
                best = val
                torch.save({"model": net.module.state_dict(), "epoch": ep, "val": val,
                            "cfg": vars(args)}, os.path.join(args.save, "best.pt"))
        dist.barrier()

    sd = torch.load(os.path.join(args.save, "best.pt"), map_location=dev)
    net.module.load_state_dict(sd["model"])
    test = evaluate(net, test_dl, dev)
    if rank == 0:
        print(f"M4 {args.freq} test sMAPE: {test:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
