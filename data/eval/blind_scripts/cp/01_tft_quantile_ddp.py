"""Temporal Fusion Transformer (simplified) for multi-horizon quantile forecasting.

Trains on the favorita-style daily sales panel (one row per series/date) with
static categorical features, known-future calendar features and past observed
covariates.  Launch with torchrun.
"""
import argparse
import contextlib
import json
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
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

QUANTILES = (0.1, 0.5, 0.9)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/panel/sales_daily.parquet")
    p.add_argument("--out_dir", default="runs/tft_q")
    p.add_argument("--lookback", type=int, default=90)
    p.add_argument("--horizon", type=int, default=28)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--cov_dropout", type=float, default=0.15,
                   help="probability of hiding the observed covariates for a step")
    p.add_argument("--batch_size", type=int, default=256)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--val_days", type=int, default=56)
    p.add_argument("--test_days", type=int, default=28)
    p.add_argument("--resume", default="")
    return p.parse_args()


class PanelWindows(Dataset):
    """Windows (lookback + horizon) cut from every series of a panel."""

    def __init__(self, y, x_known, x_obs, static, starts, lookback, horizon):
        self.y, self.x_known, self.x_obs, self.static = y, x_known, x_obs, static
        self.starts = starts  # array of (series_idx, t0)
        self.L, self.H = lookback, horizon

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        s, t0 = self.starts[i]
        t1, t2 = t0 + self.L, t0 + self.L + self.H
        return {
            "y_past": torch.from_numpy(self.y[s, t0:t1]).float(),
            "obs_past": torch.from_numpy(self.x_obs[s, t0:t1]).float(),
            "known": torch.from_numpy(self.x_known[t0:t2]).float(),
            "static": torch.from_numpy(self.static[s]).long(),
            "y_future": torch.from_numpy(self.y[s, t1:t2]).float(),
        }


def make_starts(n_series, t_lo, t_hi, lookback, horizon, stride=1):
    starts = []
    for s in range(n_series):
        for t0 in range(t_lo, t_hi - lookback - horizon + 1, stride):
            starts.append((s, t0))
    return np.asarray(starts, dtype=np.int64)


class GRN(nn.Module):
    def __init__(self, d_in, d_hidden, d_out, dropout):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, 2 * d_out)
        self.skip = nn.Linear(d_in, d_out) if d_in != d_out else nn.Identity()
        self.drop = nn.Dropout(dropout)
        self.norm = nn.LayerNorm(d_out)

    def forward(self, x):
        h = self.drop(F.elu(self.fc1(x)))
        h = F.glu(self.fc2(h), dim=-1)
        return self.norm(h + self.skip(x))


class TFT(nn.Module):
    def __init__(self, n_known, n_obs, static_cards, hidden, heads, horizon, dropout, cov_dropout):
        super().__init__()
        self.horizon = horizon
        self.cov_dropout = cov_dropout
        self.static_emb = nn.ModuleList([nn.Embedding(c, hidden) for c in static_cards])
        self.static_ctx = GRN(hidden, hidden, hidden, dropout)
        self.target_proj = nn.Linear(1, hidden)
        self.obs_enc = GRN(n_obs, hidden, hidden, dropout)
        self.known_enc = GRN(n_known, hidden, hidden, dropout)
        self.lstm_enc = nn.LSTM(hidden, hidden, batch_first=True)
        self.lstm_dec = nn.LSTM(hidden, hidden, batch_first=True)
        self.attn = nn.MultiheadAttention(hidden, heads, dropout=dropout, batch_first=True)
        self.post = GRN(hidden, hidden, hidden, dropout)
        self.head = nn.Linear(hidden, len(QUANTILES))

    def forward(self, y_past, obs_past, known, static):
        L = y_past.shape[1]
        s = sum(emb(static[:, i]) for i, emb in enumerate(self.static_emb))
        ctx = self.static_ctx(s)
        past = self.target_proj(y_past.unsqueeze(-1)) + self.known_enc(known[:, :L])
        # covariate dropout: sometimes train without the observed covariates so the
        # model stays usable when they are late or missing at inference time
        if not (self.training and torch.rand(()) < self.cov_dropout):
            past = past + self.obs_enc(obs_past)
        h0 = ctx.unsqueeze(0)
        enc, (h, c) = self.lstm_enc(past + ctx.unsqueeze(1), (h0, torch.zeros_like(h0)))
        fut = self.known_enc(known[:, L:]) + ctx.unsqueeze(1)
        dec, _ = self.lstm_dec(fut, (h, c))
        seq = torch.cat([enc, dec], dim=1)
        T = seq.shape[1]
        mask = torch.triu(torch.ones(T, T, device=seq.device, dtype=torch.bool), 1)
        att, _ = self.attn(seq, seq, seq, attn_mask=mask, need_weights=False)
        out = self.post(att[:, -self.horizon:] + dec)
        return self.head(out)  # (B, H, Q)


def quantile_loss(pred, target, quantiles=QUANTILES):
    q = torch.tensor(quantiles, device=pred.device).view(1, 1, -1)
    err = target.unsqueeze(-1) - pred
    return torch.maximum(q * err, (q - 1) * err).mean()


@torch.no_grad()
def evaluate(model, loader, device, mu, sd):
    model.eval()
    stats = torch.zeros(4, device=device, dtype=torch.float64)  # ql_sum, ae_sum, se_sum, n
    for b in loader:
        b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
        pred = model(b["y_past"], b["obs_past"], b["known"], b["static"])
        ql = quantile_loss(pred, b["y_future"]) * b["y_future"].numel()
        med = pred[..., QUANTILES.index(0.5)] * sd + mu
        y = b["y_future"] * sd + mu
        stats += torch.stack([ql.double(), (med - y).abs().sum().double(),
                              ((med - y) ** 2).sum().double(),
                              torch.tensor(y.numel(), device=device, dtype=torch.float64)])
    dist.all_reduce(stats)
    n = stats[3].item()
    model.train()
    return {"qloss": stats[0].item() / n, "mae": stats[1].item() / n,
            "rmse": math.sqrt(stats[2].item() / n)}


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)
    np.random.seed(1234)

    df = pd.read_parquet(args.data)
    piv = df.pivot(index="series_id", columns="date", values="sales").sort_index()
    y = np.log1p(piv.fillna(0.0).to_numpy(np.float32))
    obs = df.pivot(index="series_id", columns="date", values="onpromotion").sort_index()
    obs = obs.fillna(0.0).to_numpy(np.float32)[..., None]
    dates = pd.to_datetime(piv.columns)
    known = np.stack([dates.dayofweek / 6.0, dates.day / 31.0, dates.month / 12.0,
                      dates.isocalendar().week.to_numpy() / 53.0], axis=1).astype(np.float32)
    meta = df.drop_duplicates("series_id").set_index("series_id").loc[piv.index]
    static_cols = ["store_nbr", "family", "cluster"]
    static = np.stack([meta[c].astype("category").cat.codes.to_numpy() for c in static_cols], 1)
    cards = [int(static[:, i].max()) + 1 for i in range(static.shape[1])]

    T = y.shape[1]
    t_val, t_test = T - args.val_days - args.test_days, T - args.test_days
    mu, sd = float(y[:, :t_val].mean()), float(y[:, :t_val].std() + 1e-6)
    y = (y - mu) / sd

    L, H = args.lookback, args.horizon
    tr = PanelWindows(y, known, obs, static, make_starts(len(y), 0, t_val, L, H), L, H)
    va = PanelWindows(y, known, obs, static, make_starts(len(y), t_val - L, t_test, L, H, stride=7), L, H)
    te = PanelWindows(y, known, obs, static, make_starts(len(y), t_test - L, T, L, H, stride=H), L, H)

    tr_sampler = DistributedSampler(tr, shuffle=True, drop_last=True)
    mk = lambda ds, smp: DataLoader(ds, batch_size=args.batch_size, sampler=smp,
                                    num_workers=args.workers, pin_memory=True)
    tr_loader = mk(tr, tr_sampler)
    # eval shards without padding so every window is counted exactly once
    va_loader = mk(Subset(va, range(rank, len(va), world)), None)
    te_loader = mk(Subset(te, range(rank, len(te), world)), None)

    model = TFT(known.shape[1], obs.shape[2], cards, args.hidden, args.heads, H,
                args.dropout, args.cov_dropout).to(device)
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    steps = args.epochs * len(tr_loader) // args.accum
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=steps, pct_start=0.1)
    start_epoch, best = 0, float("inf")
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]

    os.makedirs(args.out_dir, exist_ok=True)
    for epoch in range(start_epoch, args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        t0, run = time.time(), 0.0
        for i, b in enumerate(tr_loader):
            b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
            sync = (i + 1) % args.accum == 0
            ctx = model.no_sync() if not sync else contextlib.nullcontext()
            with ctx:
                pred = model(b["y_past"], b["obs_past"], b["known"], b["static"])
                loss = quantile_loss(pred, b["y_future"]) / args.accum
                loss.backward()
            run += loss.item()
            if sync:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
        m = evaluate(model, va_loader, device, mu, sd)
        if rank == 0:
            print(f"epoch {epoch} train_q {run * args.accum / len(tr_loader):.4f} "
                  f"val {json.dumps(m)} {time.time() - t0:.0f}s", flush=True)
            ck = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                  "sched": sched.state_dict(), "epoch": epoch, "best": min(best, m["qloss"]),
                  "norm": {"mu": mu, "sd": sd}}
            torch.save(ck, os.path.join(args.out_dir, "last.pt"))
            if m["qloss"] < best:
                torch.save(ck, os.path.join(args.out_dir, "best.pt"))
        best = min(best, m["qloss"])
        dist.barrier()

    ck = torch.load(os.path.join(args.out_dir, "best.pt"), map_location="cpu")
    model.module.load_state_dict(ck["model"])
    m = evaluate(model, te_loader, device, mu, sd)
    if rank == 0:
        print("test", json.dumps(m))
        with open(os.path.join(args.out_dir, "test_metrics.json"), "w") as f:
            json.dump(m, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
