"""
Multi-horizon load forecasting for substations (one CSV per substation,
hourly readings + weather covariates). Seq2seq LSTM, 168h in -> 24h out.

torchrun --nproc_per_node=4 07_electricity_lstm_forecast.py --data_dir data/substations
"""
import argparse
import glob
import logging
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset

FEATURES = ["load_mw", "temp_c", "humidity", "wind_ms", "hour_sin", "hour_cos", "dow_sin", "dow_cos", "holiday"]
TARGET = "load_mw"

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
log = logging.getLogger("forecast")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", default="data/substations")
    ap.add_argument("--input_len", type=int, default=168)
    ap.add_argument("--horizon", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch_size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--val_frac", type=float, default=0.15)
    ap.add_argument("--out", default="runs/lstm_forecast")
    return ap.parse_args()


def add_calendar(df):
    ts = pd.to_datetime(df["timestamp"])
    df["hour_sin"] = np.sin(2 * np.pi * ts.dt.hour / 24)
    df["hour_cos"] = np.cos(2 * np.pi * ts.dt.hour / 24)
    df["dow_sin"] = np.sin(2 * np.pi * ts.dt.dayofweek / 7)
    df["dow_cos"] = np.cos(2 * np.pi * ts.dt.dayofweek / 7)
    return df


class StationWindows(Dataset):
    """Sliding windows over one substation series, normalised with its own train statistics."""

    def __init__(self, values, input_len, horizon, mean, std):
        self.x = ((values - mean) / std).astype(np.float32)
        self.input_len = input_len
        self.horizon = horizon
        self.t_idx = FEATURES.index(TARGET)

    def __len__(self):
        return max(0, len(self.x) - self.input_len - self.horizon + 1)

    def __getitem__(self, i):
        past = self.x[i:i + self.input_len]
        fut = self.x[i + self.input_len:i + self.input_len + self.horizon, self.t_idx]
        return torch.from_numpy(past), torch.from_numpy(fut)


def load_station(path, args):
    df = add_calendar(pd.read_csv(path))
    df[FEATURES] = df[FEATURES].interpolate(limit_direction="both")
    vals = df[FEATURES].values
    n_val = int(len(vals) * args.val_frac)
    train_vals, val_vals = vals[:-n_val], vals[-n_val - args.input_len:]
    mean, std = train_vals.mean(0), train_vals.std(0) + 1e-6
    return (StationWindows(train_vals, args.input_len, args.horizon, mean, std),
            StationWindows(val_vals, args.input_len, args.horizon, mean, std))


class Seq2SeqLSTM(nn.Module):
    def __init__(self, n_feat, hidden, layers, horizon):
        super().__init__()
        self.encoder = nn.LSTM(n_feat, hidden, layers, batch_first=True, dropout=0.1)
        self.decoder = nn.LSTM(1, hidden, layers, batch_first=True, dropout=0.1)
        self.proj = nn.Linear(hidden, 1)
        self.horizon = horizon

    def forward(self, x):
        _, (h, c) = self.encoder(x)
        last = x[:, -1:, 0:1]  # last observed (normalised) load
        dec_in = last.repeat(1, self.horizon, 1)
        out, _ = self.decoder(dec_in, (h, c))
        return self.proj(out).squeeze(-1)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    # each rank reads its own subset of substations, so no rank holds every file in memory
    files = sorted(glob.glob(os.path.join(args.data_dir, "*.csv")))
    my_files = files[rank::world]
    train_parts, val_parts = zip(*[load_station(f, args) for f in my_files])
    train_ds, val_ds = ConcatDataset(train_parts), ConcatDataset(val_parts)
    log.info(f"rank {rank}: {len(my_files)} stations, {len(train_ds)} train windows, {len(val_ds)} val windows")

    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=4,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=1024, shuffle=False, num_workers=4)

    model = Seq2SeqLSTM(len(FEATURES), args.hidden, args.layers, args.horizon).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * world)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=3)
    loss_fn = nn.SmoothL1Loss()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = float("inf")
    for epoch in range(args.epochs):
        model.train()
        tr = torch.zeros(2, device=device)
        for step, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            pred = model(x)
            loss = loss_fn(pred, y)
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            tr += torch.tensor([loss.item() * len(y), len(y)], device=device)

        model.eval()
        va = torch.zeros(3, device=device)  # abs err sum, sq err sum, count
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device), y.to(device)
                pred = model.module(x)
                va[0] += (pred - y).abs().sum()
                va[1] += ((pred - y) ** 2).sum()
                va[2] += y.numel()
        dist.all_reduce(tr)
        dist.all_reduce(va)
        train_loss = (tr[0] / tr[1]).item()
        val_mae = (va[0] / va[2]).item()
        val_rmse = (va[1] / va[2]).sqrt().item()
        scheduler.step(val_mae)

        if rank == 0:
            log.info(f"epoch {epoch:02d} train {train_loss:.4f} | val MAE {val_mae:.4f} RMSE {val_rmse:.4f}")
            if val_mae < best:
                best = val_mae
                torch.save({"model": model.module.state_dict(), "args": vars(args), "epoch": epoch},
                           os.path.join(args.out, "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
