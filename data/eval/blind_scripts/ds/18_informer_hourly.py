"""Transformer encoder with series decomposition for hourly checkout volume.

Per-series normalisation (RevIN-style: each window is normalised by its own
context mean / std, and the forecast is de-normalised the same way).

    torchrun --nproc_per_node=4 18_informer_hourly.py --csv /data/checkouts_hourly.csv
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
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

LOG = logging.getLogger("hourly")


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", default="/data/checkouts_hourly.csv")
    p.add_argument("--out", default="runs/hourly_tf")
    p.add_argument("--ctx", type=int, default=24 * 14)
    p.add_argument("--pred", type=int, default=24 * 2)
    p.add_argument("--val_hours", type=int, default=24 * 28)
    p.add_argument("--d_model", type=int, default=128)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ma", type=int, default=25)
    p.add_argument("--batch_size", type=int, default=96)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


def read(csv):
    df = pd.read_csv(csv, parse_dates=["hour"])
    wide = df.pivot_table(index="store_lane", columns="hour", values="checkouts", aggfunc="sum")
    full_range = pd.date_range(wide.columns.min(), wide.columns.max(), freq="h")
    wide = wide.reindex(columns=full_range).fillna(0.0)
    hod = wide.columns.hour.to_numpy()
    return wide.to_numpy(np.float32), hod


class HourWindows(Dataset):
    def __init__(self, y, hod, ctx, pred, lo, hi, stride):
        self.y, self.hod, self.ctx, self.pred = y, hod, ctx, pred
        self.ix = [(s, t) for s in range(len(y)) for t in range(lo, hi - ctx - pred + 1, stride)]

    def __len__(self):
        return len(self.ix)

    def __getitem__(self, i):
        s, t = self.ix[i]
        w = self.y[s, t:t + self.ctx + self.pred]
        hod = self.hod[t:t + self.ctx + self.pred].astype(np.int64)
        return torch.from_numpy(w[:self.ctx]), torch.from_numpy(hod), torch.from_numpy(w[self.ctx:])


class Decomp(nn.Module):
    def __init__(self, k):
        super().__init__()
        self.k = k

    def forward(self, x):  # B, L
        pad = torch.cat([x[:, :1].expand(-1, (self.k - 1) // 2), x, x[:, -1:].expand(-1, self.k // 2)], 1)
        trend = F.avg_pool1d(pad.unsqueeze(1), self.k, stride=1).squeeze(1)
        return x - trend, trend


class DecompTransformer(nn.Module):
    def __init__(self, ctx, pred, d_model, layers, heads, ma):
        super().__init__()
        self.ctx, self.pred = ctx, pred
        self.decomp = Decomp(ma)
        self.val = nn.Linear(1, d_model)
        self.hod = nn.Embedding(24, d_model)
        enc_layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, 0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(enc_layer, layers)
        self.seasonal_head = nn.Linear(d_model * ctx, pred)
        self.trend_head = nn.Linear(ctx, pred)

    def forward(self, x, hod):
        mu = x.mean(1, keepdim=True)
        sd = x.std(1, keepdim=True) + 1e-3
        z = (x - mu) / sd
        seasonal, trend = self.decomp(z)
        h = self.val(seasonal.unsqueeze(-1)) + self.hod(hod[:, :self.ctx])
        h = self.encoder(h)
        out = self.seasonal_head(h.flatten(1)) + self.trend_head(trend)
        return out * sd + mu


@torch.no_grad()
def evaluate(model, y, hod, args, rank, world, device):
    model.eval()
    T = y.shape[1]
    lo = T - args.val_hours - args.ctx
    ds = HourWindows(y, hod, args.ctx, args.pred, lo, T, stride=args.pred)
    mine = torch.utils.data.Subset(ds, range(rank, len(ds), world))
    dl = DataLoader(mine, batch_size=512, num_workers=2)
    agg = torch.zeros(3, dtype=torch.float64, device=device)
    for x, h, t in dl:
        x, h, t = x.to(device), h.to(device), t.to(device)
        p = model(x, h).clamp_min(0)
        agg[0] += (p - t).abs().sum().double()
        agg[1] += t.abs().sum().double()
        agg[2] += ((p - t) ** 2).sum().double()
    dist.all_reduce(agg)
    n_points = len(ds) * args.pred
    model.train()
    return (agg[0] / agg[1]).item(), math.sqrt(agg[2].item() / n_points)


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")
    torch.manual_seed(0)

    y, hod = read(args.csv)
    T = y.shape[1]
    train_hi = T - args.val_hours
    train_ds = HourWindows(y, hod, args.ctx, args.pred, 0, train_hi, stride=6)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                        num_workers=args.workers, pin_memory=True, prefetch_factor=4,
                        persistent_workers=True)

    model = DecompTransformer(args.ctx, args.pred, args.d_model, args.layers, args.heads, args.ma)
    model = DDP(model.to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    warm = 200
    total = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s / total, 1.0))))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    LOG.info("series %d, hours %d, train windows %d, %d steps/epoch", len(y), T, len(train_ds), len(loader))

    best = float("inf")
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        s = torch.zeros(2, device=device)
        for x, h, t in loader:
            x, h, t = x.to(device, non_blocking=True), h.to(device, non_blocking=True), t.to(device, non_blocking=True)
            level = x.mean(1, keepdim=True) + 1.0
            loss = F.l1_loss(model(x, h) / level, t / level)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            s += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(s)
        wape, rmse = evaluate(model.module, y, hod, args, rank, world, device)
        LOG.info("epoch %d loss %.4f val_wape %.4f val_rmse %.2f %.0fs", epoch,
                 (s[0] / s[1]).item(), wape, rmse, time.time() - t0)
        if rank == 0 and wape < best:
            best = wape
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "val_wape": wape,
                        "args": vars(args)}, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
