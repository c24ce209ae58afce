"""Traffic-sensor speed forecasting (METR-LA style, per-sensor univariate + time features).

Seq2seq LSTM, Lightning Fabric.  Resumable.

    python 09_ts_traffic_fabric_lstm.py --data data/metr_la.h5 --devices 4
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

IN_LEN, OUT_LEN = 12, 12


def time_features(index):
    tod = (index.hour * 60 + index.minute) / 1440.0
    dow = index.dayofweek / 6.0
    return np.stack([np.sin(2 * np.pi * tod), np.cos(2 * np.pi * tod), dow], 1).astype(np.float32)


class SensorWindows(Dataset):
    def __init__(self, speed, tfeat, t0, t1, mean, std):
        self.x = ((speed - mean) / std).astype(np.float32)  # [T, N]
        self.tf = tfeat
        self.n_sensors = speed.shape[1]
        self.starts = np.arange(t0, t1 - IN_LEN - OUT_LEN)

    def __len__(self):
        return len(self.starts) * self.n_sensors

    def __getitem__(self, i):
        t, s = divmod(i, self.n_sensors)
        t = self.starts[t]
        hist = np.concatenate([self.x[t:t + IN_LEN, s:s + 1], self.tf[t:t + IN_LEN]], 1)
        fut_tf = self.tf[t + IN_LEN:t + IN_LEN + OUT_LEN]
        y = self.x[t + IN_LEN:t + IN_LEN + OUT_LEN, s]
        return torch.from_numpy(hist), torch.from_numpy(fut_tf), torch.from_numpy(y), s


class Seq2Seq(nn.Module):
    def __init__(self, n_sensors, hidden=128, layers=2, emb=16, dropout=0.1):
        super().__init__()
        self.sensor = nn.Embedding(n_sensors, emb)
        self.enc = nn.LSTM(4 + emb, hidden, layers, batch_first=True, dropout=dropout)
        self.dec = nn.LSTM(3 + emb, hidden, layers, batch_first=True, dropout=dropout)
        self.out = nn.Linear(hidden, 1)

    def forward(self, hist, fut_tf, sid):
        e = self.sensor(sid)
        _, state = self.enc(torch.cat([hist, e[:, None].expand(-1, hist.size(1), -1)], -1))
        d, _ = self.dec(torch.cat([fut_tf, e[:, None].expand(-1, fut_tf.size(1), -1)], -1), state)
        return self.out(d).squeeze(-1)


def masked_mae(pred, y, null_val):
    mask = (y != null_val).float()
    return ((pred - y).abs() * mask).sum(), mask.sum()


def run_eval(fabric, model, loader, mean, std):
    model.eval()
    null_val = (0.0 - mean) / std
    abs_sum = torch.zeros((), device=fabric.device)
    cnt = torch.zeros((), device=fabric.device)
    with torch.no_grad():
        for hist, fut_tf, y, sid in loader:
            pred = model(hist, fut_tf, sid)
            a, c = masked_mae(pred.float(), y, null_val)
            abs_sum += a
            cnt += c
    abs_sum = fabric.all_reduce(abs_sum, reduce_op="sum")
    cnt = fabric.all_reduce(cnt, reduce_op="sum")
    model.train()
    return (abs_sum / cnt.clamp_min(1)).item() * std


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/metr_la.h5")
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--bs", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--ckpt-dir", default="ckpt/traffic")
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()

    fabric = Fabric(accelerator="cuda", devices=args.devices, strategy="ddp",
                    precision="bf16-mixed", loggers=CSVLogger("logs", name="traffic_lstm"))
    fabric.launch()
    fabric.seed_everything(5 + fabric.global_rank)

    df = pd.read_hdf(args.data)
    speed = df.values.astype(np.float32)
    tfeat = time_features(df.index)
    n = len(speed)
    t_train, t_val = int(0.7 * n), int(0.8 * n)
    mean, std = float(speed[:t_train].mean()), float(speed[:t_train].std())
    train_ds = SensorWindows(speed, tfeat, 0, t_train, mean, std)
    val_ds = SensorWindows(speed, tfeat, t_train - IN_LEN, t_val, mean, std)

    torch.manual_seed(5)
    model = Seq2Seq(speed.shape[1])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[20, 40, 50], gamma=0.3)
    model, opt = fabric.setup(model, opt)

    train_dl = DataLoader(train_ds, batch_size=args.bs, shuffle=True, num_workers=6,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=4096, shuffle=False, num_workers=4, pin_memory=True)
    train_dl, val_dl = fabric.setup_dataloaders(train_dl, val_dl)

    state = {"model": model, "opt": opt, "sched": sched, "epoch": 0, "best": float("inf")}
    last_path = os.path.join(args.ckpt_dir, "last.ckpt")
    if args.resume and os.path.exists(last_path):
        fabric.load(last_path, state)
        fabric.print(f"resumed from epoch {state['epoch']}")

    null_val = (0.0 - mean) / std
    for epoch in range(state["epoch"], args.epochs):
        t0 = time.time()
        for step, (hist, fut_tf, y, sid) in enumerate(train_dl):
            pred = model(hist, fut_tf, sid)
            s, c = masked_mae(pred.float(), y, null_val)
            loss = s / c.clamp_min(1)
            opt.zero_grad(set_to_none=True)
            fabric.backward(loss)
            fabric.clip_gradients(model, opt, max_norm=5.0)
            opt.step()
            if step % 200 == 0:
                fabric.log("train/mae_scaled", loss.item(), step=epoch * len(train_dl) + step)
        sched.step()

        val_mae = run_eval(fabric, model, val_dl, mean, std)
        fabric.log_dict({"val/mae_mph": val_mae, "epoch": epoch}, step=(epoch + 1) * len(train_dl))
        fabric.print(f"epoch {epoch:3d}  val MAE {val_mae:.3f} mph  ({time.time() - t0:.0f}s)")

        state["epoch"] = epoch + 1
        if val_mae < state["best"]:
            state["best"] = val_mae
            fabric.save(os.path.join(args.ckpt_dir, "best.ckpt"), state)
        fabric.save(last_path, state)

    fabric.print(f"done, best val MAE {state['best']:.3f}")


if __name__ == "__main__":
    main()
