"""
Store-item sales forecasting with a seq2seq-ish LSTM.
Single machine, uses all visible GPUs through nn.DataParallel.

    CUDA_VISIBLE_DEVICES=0,1,2,3 python 10_lstm_sales_dataparallel.py --data data/sales_train.csv
"""
import argparse
import os
import time

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data/sales_train.csv")
    p.add_argument("--window", type=int, default=90)
    p.add_argument("--horizon", type=int, default=28)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch_size", type=int, default=1024)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--patience", type=int, default=5)
    p.add_argument("--out_dir", default="out_lstm_sales")
    return p.parse_args()


class SalesWindows(Dataset):
    def __init__(self, series, window, horizon, start, end):
        # series: (n_series, T) log1p-transformed daily sales
        self.series = series
        self.window, self.horizon = window, horizon
        self.starts = np.arange(start, end - window - horizon + 1, 7)  # weekly stride
        self.n = series.shape[0]

    def __len__(self):
        return self.n * len(self.starts)

    def __getitem__(self, idx):
        s, k = divmod(idx, len(self.starts))
        t = self.starts[k]
        x = self.series[s, t: t + self.window]
        y = self.series[s, t + self.window: t + self.window + self.horizon]
        return torch.from_numpy(x).float().unsqueeze(-1), torch.from_numpy(y).float()


class SalesLSTM(nn.Module):
    def __init__(self, hidden, layers, horizon, dropout=0.2):
        super().__init__()
        self.lstm = nn.LSTM(1, hidden, num_layers=layers, batch_first=True, dropout=dropout)
        self.head = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, horizon))
        self.loss_fn = nn.SmoothL1Loss()

    def forward(self, x, y=None):
        # replicas get a fresh copy of the weights, keep cuDNN happy
        self.lstm.flatten_parameters()
        out, _ = self.lstm(x)
        pred = self.head(out[:, -1])
        if y is not None:
            return pred, self.loss_fn(pred, y)
        return pred


def load_series(path):
    df = pd.read_csv(path, parse_dates=["date"])
    pivot = df.pivot_table(index=["store", "item"], columns="date", values="sales", aggfunc="sum").fillna(0)
    return np.log1p(pivot.values.astype(np.float32))


def main():
    args = parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n_gpus = torch.cuda.device_count()
    print(f"Using {n_gpus} GPUs")

    series = load_series(args.data)
    T = series.shape[1]
    split = T - 2 * args.horizon - args.window
    train_ds = SalesWindows(series, args.window, args.horizon, 0, split + args.window + args.horizon)
    val_ds = SalesWindows(series, args.window, args.horizon, split, T)
    print(f"{series.shape[0]} series x {T} days | {len(train_ds)} train windows, {len(val_ds)} val windows")

    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=8,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, shuffle=False, num_workers=8, pin_memory=True)

    model = SalesLSTM(args.hidden, args.layers, args.horizon)
    if n_gpus > 1:
        model = nn.DataParallel(model)
    model = model.to(device)

    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=2)

    history = {"train": [], "val": []}
    best_val, bad = float("inf"), 0
    for epoch in range(1, args.epochs + 1):
        model.train()
        t0 = time.time()
        total, count = 0.0, 0
        for x, y in tqdm(train_loader, desc=f"epoch {epoch}", leave=False):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad()
            _, loss = model(x, y)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            total += loss.item() * x.size(0)
            count += x.size(0)
        train_loss = total / count

        model.eval()
        vtotal, vcount, mae_sum = 0.0, 0, 0.0
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device), y.to(device)
                pred = model(x)
                vtotal += nn.functional.smooth_l1_loss(pred, y, reduction="sum").item()
                mae_sum += (torch.expm1(pred) - torch.expm1(y)).abs().sum().item()
                vcount += y.numel()
        val_loss = vtotal / vcount
        val_mae = mae_sum / vcount
        scheduler.step(val_loss)

        history["train"].append(train_loss)
        history["val"].append(val_loss)
        print(f"epoch {epoch:02d} | train {train_loss:.4f} | val {val_loss:.4f} | "
              f"val MAE (units) {val_mae:.3f} | {time.time() - t0:.1f}s")

        if val_loss < best_val:
            best_val, bad = val_loss, 0
            state = model.module.state_dict() if isinstance(model, nn.DataParallel) else model.state_dict()
            torch.save(state, os.path.join(args.out_dir, "best_lstm.pt"))
        else:
            bad += 1
            if bad >= args.patience:
                print("early stopping")
                break

    plt.figure(figsize=(7, 4))
    plt.plot(history["train"], label="train")
    plt.plot(history["val"], label="val")
    plt.xlabel("epoch")
    plt.ylabel("smooth L1")
    plt.legend()
    plt.tight_layout()
    plt.savefig(os.path.join(args.out_dir, "loss.png"))
    print(f"best val loss {best_val:.4f}")


if __name__ == "__main__":
    main()
