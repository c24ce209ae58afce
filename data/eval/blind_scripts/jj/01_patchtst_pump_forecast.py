"""PatchTST-style channel-independent forecaster for pump-station sensors.

Trains on sliding windows cut from each sensor channel of every pump, with
per-sensor z-normalisation fitted on the training span only.

    torchrun --standalone --nproc_per_node=4 01_patchtst_pump_forecast.py \
        --data-dir /mnt/shared/pumps/parquet --out-dir runs/patchtst_pump
"""
import argparse
import glob
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
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", required=True)
    p.add_argument("--out-dir", default="runs/patchtst_pump")
    p.add_argument("--seq-len", type=int, default=336)
    p.add_argument("--pred-len", type=int, default=96)
    p.add_argument("--patch-len", type=int, default=16)
    p.add_argument("--stride", type=int, default=8)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--n-layers", type=int, default=3)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--train-frac", type=float, default=0.7)
    p.add_argument("--val-frac", type=float, default=0.1)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--seed", type=int, default=2024)
    return p.parse_args()


def load_pumps(data_dir):
    series = []
    for path in sorted(glob.glob(os.path.join(data_dir, "*.parquet"))):
        df = pd.read_parquet(path).sort_values("timestamp")
        vals = df.drop(columns=["timestamp"]).interpolate(limit_direction="both").to_numpy(np.float32)
        series.append(vals)  # (T, n_sensors)
    return series


class SensorWindows(Dataset):
    """Univariate windows: one sample = (pump, sensor, start)."""

    def __init__(self, series, stats, split, seq_len, pred_len, train_frac, val_frac):
        self.seq_len, self.pred_len = seq_len, pred_len
        self.data, self.index = [], []
        for pid, arr in enumerate(series):
            T = arr.shape[0]
            n_tr, n_va = int(T * train_frac), int(T * val_frac)
            bounds = {"train": (0, n_tr),
                      "val": (n_tr - seq_len, n_tr + n_va),
                      "test": (n_tr + n_va - seq_len, T)}[split]
            mean, std = stats[pid]
            seg = (arr[bounds[0]:bounds[1]] - mean) / std
            self.data.append(seg)
            n_win = seg.shape[0] - seq_len - pred_len + 1
            for c in range(seg.shape[1]):
                for s in range(max(n_win, 0)):
                    self.index.append((pid, c, s))

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        pid, c, s = self.index[i]
        w = self.data[pid][s:s + self.seq_len + self.pred_len, c]
        return torch.from_numpy(w[:self.seq_len].copy()), torch.from_numpy(w[self.seq_len:].copy())


def fit_stats(series, train_frac):
    stats = []
    for arr in series:
        tr = arr[: int(arr.shape[0] * train_frac)]
        stats.append((tr.mean(0), tr.std(0) + 1e-5))
    return stats


class PatchTST(nn.Module):
    def __init__(self, seq_len, pred_len, patch_len, stride, d_model, n_heads, n_layers, dropout):
        super().__init__()
        self.patch_len, self.stride = patch_len, stride
        self.n_patches = (seq_len - patch_len) // stride + 2  # +1 from end padding
        self.pad = nn.ReplicationPad1d((0, stride))
        self.embed = nn.Linear(patch_len, d_model)
        self.pos = nn.Parameter(torch.randn(1, self.n_patches, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout,
                                           batch_first=True, norm_first=True, activation="gelu")
        self.encoder = nn.TransformerEncoder(layer, n_layers, norm=nn.LayerNorm(d_model))
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(self.n_patches * d_model, pred_len)

    def forward(self, x):  # x: (B, L)
        mu = x.mean(dim=1, keepdim=True)
        sigma = x.std(dim=1, keepdim=True) + 1e-5
        x = (x - mu) / sigma  # instance norm (RevIN without affine)
        x = self.pad(x.unsqueeze(1)).squeeze(1)
        patches = x.unfold(-1, self.patch_len, self.stride)  # (B, N, P)
        z = self.drop(self.embed(patches) + self.pos)
        z = self.encoder(z)
        y = self.head(z.flatten(1))
        return y * sigma + mu


@torch.no_grad()
def evaluate(model, loader, device, horizons):
    model.eval()
    sums = torch.zeros(2 + 2 * len(horizons), device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        pred = model(x)
        err = pred - y
        sums[0] += err.pow(2).sum()
        sums[1] += err.abs().sum()
        for k, h in enumerate(horizons):
            sums[2 + 2 * k] += err[:, :h].abs().sum()
            sums[3 + 2 * k] += err.shape[0] * h
    counts = torch.tensor([len(loader.sampler) * loader.dataset.pred_len], device=device,
                          dtype=torch.float64)
    dist.all_reduce(sums)
    dist.all_reduce(counts)
    out = {"mse": (sums[0] / counts).item(), "mae": (sums[1] / counts).item()}
    for k, h in enumerate(horizons):
        out[f"mae@{h}"] = (sums[2 + 2 * k] / sums[3 + 2 * k]).item()
    model.train()
    return out


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    series = load_pumps(args.data_dir)
    stats = fit_stats(series, args.train_frac)
    common = dict(seq_len=args.seq_len, pred_len=args.pred_len,
                  train_frac=args.train_frac, val_frac=args.val_frac)
    train_ds = SensorWindows(series, stats, "train", **common)
    val_ds = SensorWindows(series, stats, "val", **common)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=2 * args.batch_size, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    model = PatchTST(args.seq_len, args.pred_len, args.patch_len, args.stride,
                     args.d_model, args.n_heads, args.n_layers, args.dropout).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    # linear scaling: base lr is for a 128-sample batch on one GPU
    lr = args.lr * world * args.batch_size / 128
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.weight_decay)
    steps_per_epoch = len(train_loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, epochs=args.epochs,
                                                steps_per_epoch=steps_per_epoch, pct_start=0.3)

    writer = None
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        writer = SummaryWriter(args.out_dir)
        with open(os.path.join(args.out_dir, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)
        print(f"train windows={len(train_ds)} val windows={len(val_ds)} world={world} lr={lr:.2e}")

    horizons = [h for h in (12, 24, 48, 96) if h <= args.pred_len]
    best = math.inf
    global_step = 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            running[0] += loss.detach()
            running[1] += 1
            global_step += 1
            if rank == 0 and global_step % 100 == 0:
                writer.add_scalar("train/loss_step", loss.item(), global_step)
                writer.add_scalar("train/lr", sched.get_last_lr()[0], global_step)

        dist.all_reduce(running)
        train_loss = (running[0] / running[1]).item()
        metrics = evaluate(model, val_loader, device, horizons)

        if rank == 0:
            writer.add_scalar("train/loss", train_loss, epoch)
            for k, v in metrics.items():
                writer.add_scalar(f"val/{k}", v, epoch)
            print(f"epoch {epoch:3d} train {train_loss:.4f} val mse {metrics['mse']:.4f} "
                  f"mae {metrics['mae']:.4f} ({time.time() - t0:.0f}s)", flush=True)
            ckpt = {"model": model.module.state_dict(), "epoch": epoch, "metrics": metrics,
                    "stats": [(m.tolist(), s.tolist()) for m, s in stats], "args": vars(args)}
            torch.save(ckpt, os.path.join(args.out_dir, "last.pt"))
            if metrics["mse"] < best:
                best = metrics["mse"]
                torch.save(ckpt, os.path.join(args.out_dir, "best.pt"))
        dist.barrier()

    if rank == 0:
        writer.close()
        print(f"best val mse {best:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
