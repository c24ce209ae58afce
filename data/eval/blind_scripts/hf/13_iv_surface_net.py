"""Implied-volatility surface model for SPX options.

A small network maps (log-moneyness, time-to-expiry, day state) to total
implied variance; a soft calendar-arbitrage penalty keeps w(k, T) increasing
in T. Day state is a learned embedding of the previous close surface summary.

    torchrun --nproc_per_node=4 13_iv_surface_net.py --quotes /data/optionmetrics/spx_2015_2023.parquet
"""
import argparse
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


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quotes", required=True)
    ap.add_argument("--test-from", default="2022-01-01")
    ap.add_argument("--val-from", default="2021-01-01")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--arb-weight", type=float, default=10.0)
    ap.add_argument("--out", default="runs/ivnet")
    return ap.parse_args()


STATE_COLS = ["atm_iv_1m", "atm_iv_3m", "skew_25d_1m", "term_slope", "vix", "spx_ret_5d"]


class QuoteSet(Dataset):
    def __init__(self, df):
        self.k = torch.tensor(df["log_moneyness"].values, dtype=torch.float32)
        self.t = torch.tensor(df["tau"].values, dtype=torch.float32)
        self.state = torch.tensor(df[STATE_COLS].values, dtype=torch.float32)
        self.w = torch.tensor((df["impl_vol"] ** 2 * df["tau"]).values, dtype=torch.float32)
        self.vega = torch.tensor(df["vega"].clip(lower=1e-3).values, dtype=torch.float32)

    def __len__(self):
        return len(self.w)

    def __getitem__(self, i):
        return self.k[i], self.t[i], self.state[i], self.w[i], self.vega[i]


class IVSurfaceNet(nn.Module):
    def __init__(self, width, n_state=len(STATE_COLS)):
        super().__init__()
        self.state_enc = nn.Sequential(nn.Linear(n_state, 64), nn.Tanh(), nn.Linear(64, 32))
        self.body = nn.Sequential(
            nn.Linear(2 + 32, width), nn.Softplus(),
            nn.Linear(width, width), nn.Softplus(),
            nn.Linear(width, width), nn.Softplus(),
            nn.Linear(width, 1),
        )

    def forward(self, k, t, state):
        s = self.state_enc(state)
        z = torch.cat([k.unsqueeze(-1), torch.sqrt(t).unsqueeze(-1), s], -1)
        return F.softplus(self.body(z)).squeeze(-1)  # total variance w >= 0


def calendar_penalty(w_now, w_later):
    """penalise total variance that falls as expiry grows (calendar arbitrage)."""
    return F.relu(w_now - w_later).mean()


def iv_rmse(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device, dtype=torch.float64)
    with torch.no_grad():
        for k, t, s, w, _ in loader:
            k, t, s, w = k.to(device), t.to(device), s.to(device), w.to(device)
            iv_hat = torch.sqrt(model(k, t, s) / t)
            iv = torch.sqrt(w / t)
            acc[0] += ((iv_hat - iv) ** 2).sum().double()
            acc[1] += len(w)
    dist.all_reduce(acc)
    return (acc[0] / acc[1]).sqrt().item() * 100  # vol points


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    df = pd.read_parquet(args.quotes)
    df = df[(df.tau > 7 / 365) & (df.log_moneyness.abs() < 0.5) & (df.impl_vol.between(0.03, 2.0))]
    df[STATE_COLS] = (df[STATE_COLS] - df[STATE_COLS].mean()) / df[STATE_COLS].std()
    train = QuoteSet(df[df.date < args.val_from])
    val = QuoteSet(df[(df.date >= args.val_from) & (df.date < args.test_from)])
    test = QuoteSet(df[df.date >= args.test_from])

    tr_sampler = DistributedSampler(train, shuffle=True, drop_last=True)
    tr_loader = DataLoader(train, args.batch_size, sampler=tr_sampler, num_workers=4, pin_memory=True, drop_last=True)
    va_loader = DataLoader(val, 16384, sampler=DistributedSampler(val, shuffle=False, drop_last=True))
    te_loader = DataLoader(test, 16384, sampler=DistributedSampler(test, shuffle=False, drop_last=True))

    model = DDP(IVSurfaceNet(args.width).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.93)
    best_path = os.path.join(args.out, "best.pt")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"quotes train={len(train)} val={len(val)} test={len(test)}", flush=True)

    best = float("inf")
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for k, t, s, w, vega in tr_loader:
            k, t, s, w, vega = (x.to(device, non_blocking=True) for x in (k, t, s, w, vega))
            # one forward over the quotes and the same points bumped out by two weeks
            n = len(w)
            w_all = model(torch.cat([k, k]), torch.cat([t, t + 14 / 365]), torch.cat([s, s]))
            w_hat, w_later = w_all[:n], w_all[n:]
            # vega-weighted error in total-variance space
            fit = ((w_hat - w) ** 2 * vega / vega.mean()).mean()
            arb = calendar_penalty(w_hat, w_later)
            loss = fit * 1e4 + args.arb_weight * arb
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sched.step()

        val_rmse = iv_rmse(model, va_loader, device)
        if rank == 0:
            print(f"epoch {epoch:02d} fit {fit.item():.3e} arb {arb.item():.3e} val_rmse {val_rmse:.3f} vol pts "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if val_rmse < best:
                best = val_rmse
                torch.save(model.state_dict(), best_path)
        dist.barrier()

    # reload the best weights into a plain module for the out-of-sample report
    final = IVSurfaceNet(args.width).to(device)
    final.load_state_dict(torch.load(best_path, map_location=device))
    test_rmse = iv_rmse(final, te_loader, device)
    if rank == 0:
        print(f"best val {best:.3f} vol pts | test 2022+ {test_rmse:.3f} vol pts")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
