"""Forecasting-based anomaly detection for service KPIs (latency, error rate, qps ...).

A dilated TCN predicts the next `horizon` points of every KPI; at inference the
prediction residual is the anomaly score. Raw KPI exports have gaps and the odd
inf from division by zero, so some windows blow up early in training.

    accelerate launch --multi_gpu --num_processes 4 16_accelerate_tcn_kpi_forecast.py --data '/data/kpi/*.csv'
"""
import argparse
import glob
import logging
import math
import os

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import ConcatDataset, DataLoader, Dataset

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
log = logging.getLogger("tcn")


class KPIWindows(Dataset):
    def __init__(self, values, ctx, horizon):
        self.v = torch.tensor(values, dtype=torch.float32)
        self.ctx, self.h = ctx, horizon

    def __len__(self):
        return max(0, len(self.v) - self.ctx - self.h + 1)

    def __getitem__(self, i):
        return self.v[i:i + self.ctx], self.v[i + self.ctx:i + self.ctx + self.h]


def load_kpis(pattern, cols):
    series = []
    for path in sorted(glob.glob(pattern)):
        df = pd.read_csv(path, parse_dates=["timestamp"]).set_index("timestamp").resample("1min").mean()
        df = df[cols].replace([np.inf, -np.inf], np.nan).ffill(limit=5)
        med = df.median()
        iqr = (df.quantile(0.75) - df.quantile(0.25)).replace(0, 1.0)
        series.append(((df - med) / iqr).to_numpy())
    return series


class CausalBlock(nn.Module):
    def __init__(self, c, dilation, k=3, dropout=0.1):
        super().__init__()
        self.pad = (k - 1) * dilation
        self.conv1 = nn.utils.parametrizations.weight_norm(nn.Conv1d(c, c, k, dilation=dilation))
        self.conv2 = nn.utils.parametrizations.weight_norm(nn.Conv1d(c, c, k, dilation=dilation))
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        y = self.drop(F.gelu(self.conv1(F.pad(x, (self.pad, 0)))))
        y = self.drop(F.gelu(self.conv2(F.pad(y, (self.pad, 0)))))
        return x + y


class TCN(nn.Module):
    def __init__(self, n_kpi, ctx, horizon, channels=128, levels=7):
        super().__init__()
        self.inp = nn.Conv1d(n_kpi, channels, 1)
        self.blocks = nn.Sequential(*[CausalBlock(channels, 2 ** i) for i in range(levels)])
        self.head = nn.Linear(channels, n_kpi * horizon)
        self.n_kpi, self.h = n_kpi, horizon

    def forward(self, x):
        x = torch.nan_to_num(x, nan=0.0)
        z = self.blocks(self.inp(x.transpose(1, 2)))[:, :, -1]
        return self.head(z).view(-1, self.h, self.n_kpi)


def masked_huber(pred, target):
    m = torch.isfinite(target)
    return F.huber_loss(pred[m], target[m], delta=1.0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/kpi/*.csv")
    ap.add_argument("--kpis", default="latency_p50,latency_p99,error_rate,qps,cpu,mem")
    ap.add_argument("--ctx", type=int, default=360)
    ap.add_argument("--horizon", type=int, default=10)
    ap.add_argument("--bs", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--out", default="runs/tcn_kpi")
    args = ap.parse_args()

    accelerator = Accelerator(mixed_precision="no")
    set_seed(11)
    cols = args.kpis.split(",")
    series = load_kpis(args.data, cols)
    cut = [int(len(s) * 0.85) for s in series]
    train_ds = ConcatDataset([KPIWindows(s[:c], args.ctx, args.horizon) for s, c in zip(series, cut)])
    val_ds = ConcatDataset([KPIWindows(s[c - args.ctx:], args.ctx, args.horizon) for s, c in zip(series, cut)])
    accelerator.print(f"{len(series)} series, {len(train_ds)} train / {len(val_ds)} val windows")

    train_dl = DataLoader(train_ds, batch_size=args.bs, shuffle=True, num_workers=4, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=1024, num_workers=4)

    model = TCN(len(cols), args.ctx, args.horizon)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    model, optimizer, train_dl, val_dl = accelerator.prepare(model, optimizer, train_dl, val_dl)
    total = args.epochs * len(train_dl)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total, pct_start=0.1)

    best = math.inf
    skipped = 0
    for epoch in range(args.epochs):
        model.train()
        for step, (x, y) in enumerate(train_dl):
            pred = model(x)
            loss = masked_huber(pred, y)
            if not torch.isfinite(loss):
                skipped += 1
                log.warning("rank %d: non-finite loss at epoch %d step %d, skipping batch",
                            accelerator.process_index, epoch, step)
                optimizer.zero_grad()
                continue
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            if step % 200 == 0:
                accelerator.print(f"ep {epoch} step {step}/{len(train_dl)} loss {loss.item():.4f}")

        model.eval()
        sums = torch.zeros(2, device=accelerator.device)
        with torch.no_grad():
            for x, y in val_dl:
                pred = model(x)
                pred, y = accelerator.gather_for_metrics((pred, y))
                m = torch.isfinite(y)
                sums += torch.stack([(pred[m] - y[m]).abs().sum(), m.sum().float()])
        val_mae = (sums[0] / sums[1]).item()
        accelerator.print(f"epoch {epoch}: val MAE {val_mae:.4f} (skipped so far: {skipped})")

        if val_mae < best:
            best = val_mae
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                os.makedirs(args.out, exist_ok=True)
                accelerator.save({"model": accelerator.unwrap_model(model).state_dict(), "cols": cols,
                                  "ctx": args.ctx, "horizon": args.horizon, "epoch": epoch},
                                 os.path.join(args.out, "best.pt"))

    accelerator.print(f"done. best val MAE {best:.4f}")


if __name__ == "__main__":
    main()
