"""LSTM encoder-decoder for 12-step-ahead traffic speed forecasting (PeMS district dumps).

The raw data is one parquet file per detector station group (5-minute speed
readings, one column per detector). Each rank reads its own share of the files.

    torchrun --nproc_per_node=8 04_lstm_traffic_seq2seq.py --data-dir /data/pems/d07 --epochs 50
"""
import argparse
import glob
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset

STEPS_PER_DAY = 288


class DetectorWindows(Dataset):
    def __init__(self, speed, tod, t_start, t_end, n_in, n_out):
        self.speed = speed  # (T, D) float32 scaled, NaN where missing
        self.tod = tod  # (T,) time of day in [0, 1)
        self.n_in, self.n_out = n_in, n_out
        starts = np.arange(t_start, t_end - n_in - n_out + 1)
        dets = np.arange(speed.shape[1])
        self.index = np.stack(np.meshgrid(dets, starts, indexing="ij"), -1).reshape(-1, 2)

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        d, t = self.index[i]
        x = self.speed[t:t + self.n_in, d]
        y = self.speed[t + self.n_in:t + self.n_in + self.n_out, d]
        feats = np.stack([np.nan_to_num(x, nan=0.0), ~np.isnan(x), self.tod[t:t + self.n_in]], axis=-1)
        return torch.from_numpy(feats.astype(np.float32)), torch.from_numpy(y.astype(np.float32))


class Seq2Seq(nn.Module):
    def __init__(self, n_feat, hidden, layers, n_out, dropout):
        super().__init__()
        self.n_out = n_out
        self.encoder = nn.LSTM(n_feat, hidden, layers, batch_first=True, dropout=dropout)
        self.decoder = nn.LSTM(1, hidden, layers, batch_first=True, dropout=dropout)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x):
        _, state = self.encoder(x)
        last = x[:, -1:, :1]
        outs = []
        for _ in range(self.n_out):
            h, state = self.decoder(last, state)
            last = self.head(h)
            outs.append(last)
        return torch.cat(outs, dim=1).squeeze(-1)


def masked_mae(pred, y):
    mask = ~torch.isnan(y)
    err = (pred - torch.nan_to_num(y)).abs() * mask
    return err.sum(), mask.sum()


def load_station_file(path, args):
    df = pd.read_parquet(path).sort_index()
    speed = df.to_numpy(np.float32, copy=True)
    speed[speed <= 0] = np.nan  # loop detectors report 0 when offline
    T = len(speed)
    n_train, n_val = int(T * 0.7), int(T * 0.1)
    # scale with the training part of this file only
    mu = np.nanmean(speed[:n_train])
    sd = np.nanstd(speed[:n_train]) + 1e-6
    speed = (speed - mu) / sd
    tod = (np.arange(T) % STEPS_PER_DAY / STEPS_PER_DAY).astype(np.float32)
    train = DetectorWindows(speed, tod, 0, n_train, args.n_in, args.n_out)
    val = DetectorWindows(speed, tod, n_train - args.n_in, n_train + n_val, args.n_in, args.n_out)
    return train, val, (mu, sd)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--ckpt-dir", default="checkpoints/lstm_traffic")
    ap.add_argument("--n-in", type=int, default=12)
    ap.add_argument("--n-out", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--batch-size", type=int, default=1024, help="per GPU")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--patience", type=int, default=8)
    ap.add_argument("--workers", type=int, default=6)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    files = sorted(glob.glob(os.path.join(args.data_dir, "*.parquet")))
    my_files = files[rank::world]
    parts = [load_station_file(f, args) for f in my_files]
    train_ds = ConcatDataset([p[0] for p in parts])
    val_ds = ConcatDataset([p[1] for p in parts])
    print(f"[rank {rank}] {len(my_files)} files, {len(train_ds)} train / {len(val_ds)} val windows", flush=True)

    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, drop_last=True,
                              num_workers=args.workers, pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=4 * args.batch_size, num_workers=args.workers, pin_memory=True)

    model = Seq2Seq(3, args.hidden, args.layers, args.n_out, args.dropout).to(device)
    model = DDP(model, device_ids=[local_rank])
    # sqrt scaling of the 1-GPU learning rate for the larger global batch
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world ** 0.5)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[20, 35], gamma=0.3)

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
    best, wait = float("inf"), 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        tr = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            err, cnt = masked_mae(model(x), y)
            loss = err / cnt.clamp_min(1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            tr += torch.stack([err.detach(), cnt.float()])
        sched.step()

        model.eval()
        va = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                err, cnt = masked_mae(model.module(x), y)
                va += torch.stack([err, cnt.float()])
        dist.all_reduce(tr)
        dist.all_reduce(va)
        train_mae, val_mae = (tr[0] / tr[1]).item(), (va[0] / va[1]).item()

        if rank == 0:
            print(f"epoch {epoch:02d} train_mae {train_mae:.4f} val_mae {val_mae:.4f} "
                  f"time {time.time() - t0:.1f}s", flush=True)
        if val_mae < best:
            best, wait = val_mae, 0
            if rank == 0:
                torch.save({"epoch": epoch, "model": model.module.state_dict(), "args": vars(args)},
                           os.path.join(args.ckpt_dir, "best.pt"))
        else:
            wait += 1
            if wait >= args.patience:
                break

    if rank == 0:
        print(f"best val masked MAE (scaled units) {best:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
