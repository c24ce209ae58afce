"""Multi-horizon electricity load forecasting with a seq2seq LSTM (370 meters, hourly).

Port of the Keras encoder-decoder (LSTM(return_state=True) -> RepeatVector ->
LSTM -> TimeDistributed(Dense)). One process per GPU via torch.multiprocessing.

    python 19_lstm_forecast_spawn.py --csv data/LD2011_2014_hourly.csv --gpus 4
"""
import argparse
import os
import time
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


@dataclass
class Config:
    csv: str
    gpus: int
    lookback: int = 168
    horizon: int = 24
    hidden: int = 256
    layers: int = 2
    batch_size: int = 512  # per replica
    lr: float = 1e-3
    epochs: int = 50
    patience: int = 6
    port: int = 29533
    out: str = "runs/lstm_forecast"


class WindowDataset(Dataset):
    """Sliding (lookback -> horizon) windows over every series, tf.keras.utils.timeseries_dataset_from_array style."""

    def __init__(self, values, lookback, horizon, stride=1):
        self.values = torch.from_numpy(values.astype(np.float32))  # (T, S)
        self.lookback, self.horizon = lookback, horizon
        n_t = values.shape[0] - lookback - horizon + 1
        self.starts = np.arange(0, n_t, stride)
        self.n_series = values.shape[1]

    def __len__(self):
        return len(self.starts) * self.n_series

    def __getitem__(self, idx):
        s = idx % self.n_series
        t = self.starts[idx // self.n_series]
        x = self.values[t: t + self.lookback, s]
        y = self.values[t + self.lookback: t + self.lookback + self.horizon, s]
        return x.unsqueeze(-1), y, s


class Seq2SeqLSTM(nn.Module):
    def __init__(self, n_series, hidden, layers, horizon, emb_dim=16):
        super().__init__()
        self.series_emb = nn.Embedding(n_series, emb_dim)
        self.encoder = nn.LSTM(1 + emb_dim, hidden, layers, batch_first=True, dropout=0.1)
        self.decoder = nn.LSTM(emb_dim, hidden, layers, batch_first=True, dropout=0.1)
        self.head = nn.Linear(hidden, 1)
        self.horizon = horizon

    def forward(self, x, sid):
        e = self.series_emb(sid)
        enc_in = torch.cat([x, e[:, None, :].expand(-1, x.size(1), -1)], dim=-1)
        _, state = self.encoder(enc_in)
        dec_in = e[:, None, :].expand(-1, self.horizon, -1).contiguous()
        out, _ = self.decoder(dec_in, state)
        return self.head(out).squeeze(-1)


def load_splits(cfg):
    df = pd.read_csv(cfg.csv, index_col=0, parse_dates=True).astype(np.float32)
    df = df.loc[:, (df != 0).mean() > 0.9]
    n = len(df)
    train, val = df.iloc[: int(n * 0.8)], df.iloc[int(n * 0.8) - cfg.lookback:]
    mu, sigma = train.mean().to_numpy(), train.std().to_numpy() + 1e-3
    return (train.to_numpy() - mu) / sigma, (val.to_numpy() - mu) / sigma, list(df.columns)


def reduce_mean(pair):
    dist.all_reduce(pair)
    return (pair[0] / pair[1]).item()


def train_worker(cfg, rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(cfg.port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(0)

    train_vals, val_vals, series = load_splits(cfg)
    train_ds = WindowDataset(train_vals, cfg.lookback, cfg.horizon, stride=1)
    val_ds = WindowDataset(val_vals, cfg.lookback, cfg.horizon, stride=cfg.horizon)
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=sampler, num_workers=4,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world_size)), batch_size=4096,
                        num_workers=2, pin_memory=True)

    model = Seq2SeqLSTM(len(series), cfg.hidden, cfg.layers, cfg.horizon).to(device)
    model = DDP(model, device_ids=[rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=2)

    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)
        print(f"series={len(series)} train_windows={len(train_ds):,} val_windows={len(val_ds):,}", flush=True)

    best, wait = float("inf"), 0
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tr = torch.zeros(2, device=device)
        for x, y, sid in train_dl:
            x, y, sid = x.to(device, non_blocking=True), y.to(device, non_blocking=True), sid.to(device)
            loss = nn.functional.mse_loss(model(x, sid), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            tr += torch.stack([loss.detach() * y.size(0), torch.tensor(float(y.size(0)), device=device)])

        model.eval()
        va = torch.zeros(2, device=device)
        mae = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y, sid in val_dl:
                x, y, sid = x.to(device, non_blocking=True), y.to(device, non_blocking=True), sid.to(device)
                pred = model(x, sid)
                va += torch.stack([((pred - y) ** 2).sum(), torch.tensor(float(y.numel()), device=device)])
                mae += torch.stack([(pred - y).abs().sum(), torch.tensor(float(y.numel()), device=device)])
        train_mse, val_mse, val_mae = reduce_mean(tr), reduce_mean(va), reduce_mean(mae)
        plateau.step(val_mse)

        if rank == 0:
            print(f"Epoch {epoch + 1}/{cfg.epochs} - {time.time() - t0:.0f}s - loss: {train_mse:.4f} - "
                  f"val_mse: {val_mse:.4f} - val_mae: {val_mae:.4f} - lr: {opt.param_groups[0]['lr']:.1e}",
                  flush=True)
        if val_mse < best:
            best, wait = val_mse, 0
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "series": series, "epoch": epoch},
                           os.path.join(cfg.out, "seq2seq_best.pt"))
        else:
            wait += 1
            if wait >= cfg.patience:
                break

    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", required=True)
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=512)
    a = ap.parse_args()
    cfg = Config(csv=a.csv, gpus=a.gpus, epochs=a.epochs, batch_size=a.batch_size)
    mp.spawn(train_worker, args=(cfg, cfg.gpus), nprocs=cfg.gpus, join=True)


if __name__ == "__main__":
    main()
