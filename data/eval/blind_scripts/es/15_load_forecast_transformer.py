"""Day-ahead electricity load forecasting with a small encoder-only transformer.

Input: hourly load for N substations (parquet, one column per substation). The model sees a
168 h window plus calendar features and predicts the next 24 h.

    accelerate launch --multi_gpu --num_processes 4 15_load_forecast_transformer.py \
        --data data/substation_load.parquet --ckpt-dir ckpt/load_tf
    # resume
    accelerate launch --multi_gpu --num_processes 4 15_load_forecast_transformer.py \
        --data data/substation_load.parquet --ckpt-dir ckpt/load_tf --resume ckpt/load_tf/last.pt
"""
import argparse
import math
import os

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset

CONTEXT, HORIZON = 168, 24


class WindowDataset(Dataset):
    def __init__(self, values, timestamps, mean, std, stride=1):
        self.values = ((values - mean) / std).astype(np.float32)   # [T, S]
        hours = timestamps.hour.values
        dows = timestamps.dayofweek.values
        self.calendar = np.stack([
            np.sin(2 * np.pi * hours / 24), np.cos(2 * np.pi * hours / 24),
            np.sin(2 * np.pi * dows / 7), np.cos(2 * np.pi * dows / 7),
        ], axis=1).astype(np.float32)
        n_windows = len(values) - CONTEXT - HORIZON + 1
        self.index = [(t, s) for t in range(0, n_windows, stride) for s in range(values.shape[1])]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        t, s = self.index[i]
        x = np.concatenate([self.values[t:t + CONTEXT, s:s + 1], self.calendar[t:t + CONTEXT]], axis=1)
        y = self.values[t + CONTEXT:t + CONTEXT + HORIZON, s]
        return torch.from_numpy(x), torch.from_numpy(y), s


class LoadTransformer(nn.Module):
    def __init__(self, n_series, d_model=128, n_heads=8, n_layers=4, dropout=0.1):
        super().__init__()
        self.input_proj = nn.Linear(5, d_model)
        self.series_emb = nn.Embedding(n_series, d_model)
        self.pos = nn.Parameter(torch.zeros(1, CONTEXT, d_model))
        layer = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layers)
        self.head = nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, HORIZON))
        nn.init.trunc_normal_(self.pos, std=0.02)

    def forward(self, x, series):
        h = self.input_proj(x) + self.pos + self.series_emb(series).unsqueeze(1)
        h = self.encoder(h)
        return self.head(h[:, -1])


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--ckpt-dir", default="ckpt/load_tf")
    ap.add_argument("--resume", default=None)
    ap.add_argument("--val-days", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--seed", type=int, default=21)
    return ap.parse_args()


def main():
    args = parse_args()
    accelerator = Accelerator()
    set_seed(args.seed)

    df = pd.read_parquet(args.data).sort_index()
    df = df.interpolate(limit=6).dropna()
    split = len(df) - args.val_days * 24
    train_vals, val_vals = df.values[:split], df.values[split - CONTEXT:]
    mean, std = train_vals.mean(axis=0), train_vals.std(axis=0) + 1e-6
    train_ds = WindowDataset(train_vals, df.index[:split], mean, std, stride=1)
    val_ds = WindowDataset(val_vals, df.index[split - CONTEXT:], mean, std, stride=24)

    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=4, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=512, shuffle=False, num_workers=4)

    model = LoadTransformer(n_series=df.shape[1])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs, eta_min=1e-6)
    start_epoch, best_val = 0, math.inf
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_val = ckpt["epoch"] + 1, ckpt["best_val"]
        accelerator.print(f"resumed from {args.resume} at epoch {start_epoch}")

    model, optimizer, train_loader, val_loader = accelerator.prepare(model, optimizer, train_loader, val_loader)
    loss_fn = nn.HuberLoss(delta=1.0)
    if accelerator.is_main_process:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        model.train()
        train_loss = torch.zeros(2, device=accelerator.device)
        for x, y, series in train_loader:
            pred = model(x, series)
            loss = loss_fn(pred, y)
            optimizer.zero_grad()
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            train_loss += torch.stack([loss.detach() * y.size(0), torch.tensor(float(y.size(0)), device=y.device)])
        scheduler.step()
        train_loss = accelerator.reduce(train_loss, reduction="sum")

        model.eval()
        abs_err, sq_err, n = 0.0, 0.0, 0
        with torch.no_grad():
            for x, y, series in val_loader:
                pred = model(x, series)
                pred, y, series = accelerator.gather_for_metrics((pred, y, series))
                scale = torch.as_tensor(std, device=pred.device, dtype=pred.dtype)[series].unsqueeze(1)
                err = (pred - y) * scale
                abs_err += err.abs().sum().item()
                sq_err += (err ** 2).sum().item()
                n += err.numel()
        val_mae, val_rmse = abs_err / n, math.sqrt(sq_err / n)
        accelerator.print(f"epoch {epoch:02d} train {(train_loss[0] / train_loss[1]).item():.4f} "
                          f"val MAE {val_mae:.1f} kW RMSE {val_rmse:.1f} kW")

        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            is_best = val_mae < best_val
            best_val = min(best_val, val_mae)
            ckpt = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "epoch": epoch,
                "best_val": best_val,
                "mean": mean.tolist(),
                "std": std.tolist(),
                "columns": list(df.columns),
            }
            torch.save(ckpt, os.path.join(args.ckpt_dir, "last.pt"))
            if is_best:
                torch.save(ckpt, os.path.join(args.ckpt_dir, "best.pt"))
        accelerator.wait_for_everyone()

    accelerator.end_training()


if __name__ == "__main__":
    main()
