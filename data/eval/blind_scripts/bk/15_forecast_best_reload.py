"""
Multi-horizon load forecasting (electricity, 321 clients) with a small
Transformer encoder. Data parallel with explicit gradient all_reduce; rank 0
keeps the best checkpoint on validation MAE and at the end every rank reloads
it to score its part of the test windows.

    torchrun --nproc_per_node=4 15_forecast_best_reload.py --csv data/electricity.csv
"""
import argparse
import math
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", required=True)
    p.add_argument("--lookback", type=int, default=168)
    p.add_argument("--horizon", type=int, default=24)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ckpt-dir", default="ckpt/elec")
    return p.parse_args()


class Windows(Dataset):
    def __init__(self, values, lookback, horizon, start, end):
        self.v = values  # T x C, already scaled
        self.lb, self.h = lookback, horizon
        self.idx = [(t, c) for t in range(max(start, lookback), end - horizon + 1, 6)
                    for c in range(values.shape[1])]

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, i):
        t, c = self.idx[i]
        x = self.v[t - self.lb:t, c]
        y = self.v[t:t + self.h, c]
        return torch.from_numpy(x).unsqueeze(-1), torch.from_numpy(y), c


class Forecaster(nn.Module):
    def __init__(self, n_series, lookback, horizon, d_model, layers):
        super().__init__()
        self.inp = nn.Linear(1, d_model)
        self.series_emb = nn.Embedding(n_series, d_model)
        self.pos = nn.Parameter(torch.randn(1, lookback, d_model) * 0.02)
        enc_layer = nn.TransformerEncoderLayer(d_model, 8, 4 * d_model, dropout=0.1, batch_first=True,
                                               norm_first=True)
        self.enc = nn.TransformerEncoder(enc_layer, layers)
        self.out = nn.Linear(d_model, horizon)

    def forward(self, x, series):
        h = self.inp(x) + self.pos + self.series_emb(series)[:, None, :]
        h = self.enc(h)
        return self.out(h[:, -1])


def load_values(path):
    df = pd.read_csv(path, index_col=0, parse_dates=True).astype(np.float32)
    v = df.to_numpy()
    n_train = int(0.7 * len(v))
    mu, sd = v[:n_train].mean(0), v[:n_train].std(0) + 1e-6  # train statistics only
    return ((v - mu) / sd).astype(np.float32), n_train, int(0.8 * len(v))


def average_gradients(model, world):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad.mul_(1.0 / world)


@torch.no_grad()
def score(model, loader, device):
    model.eval()
    acc = torch.zeros(3, device=device, dtype=torch.float64)
    for x, y, c in loader:
        x, y, c = x.to(device), y.to(device), c.to(device)
        pred = model(x, c)
        acc[0] += (pred - y).abs().sum()
        acc[1] += ((pred - y) ** 2).sum()
        acc[2] += y.numel()
    dist.all_reduce(acc)
    return (acc[0] / acc[2]).item(), math.sqrt((acc[1] / acc[2]).item())


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(11)

    values, t_train, t_val = load_values(args.csv)
    n_series = values.shape[1]
    train_ds = Windows(values, args.lookback, args.horizon, 0, t_train)
    val_ds = Windows(values, args.lookback, args.horizon, t_train, t_val)
    test_ds = Windows(values, args.lookback, args.horizon, t_val, len(values))

    def shard(ds):
        return torch.utils.data.Subset(ds, range(rank, len(ds), world))

    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=4,
                          drop_last=True, pin_memory=True)
    val_dl = DataLoader(shard(val_ds), batch_size=1024, num_workers=2)
    test_dl = DataLoader(shard(test_ds), batch_size=1024, num_workers=2)

    model = Forecaster(n_series, args.lookback, args.horizon, args.d_model, args.layers).to(device)
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(train_dl))

    best_path = os.path.join(args.ckpt_dir, "best.pt")
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        print(f"{n_series} series, {len(train_ds)} train windows, {len(train_dl)} steps/epoch", flush=True)

    best_mae = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        total = torch.zeros(2, device=device)
        for x, y, c in train_dl:
            x, y, c = x.to(device, non_blocking=True), y.to(device, non_blocking=True), c.to(device)
            loss = F.smooth_l1_loss(model(x, c), y, beta=0.5)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            average_gradients(model, world)
            nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            sched.step()
            total[0] += loss.detach()
            total[1] += 1
        dist.all_reduce(total)

        val_mae, val_rmse = score(model, val_dl, device)
        if val_mae < best_mae:
            best_mae = val_mae
            if rank == 0:
                torch.save({"model": model.state_dict(), "epoch": epoch, "val_mae": val_mae,
                            "args": vars(args)}, best_path)
        if rank == 0:
            print(f"epoch {epoch} train {(total[0] / total[1]).item():.4f} val MAE {val_mae:.4f} "
                  f"RMSE {val_rmse:.4f} best {best_mae:.4f} ({time.time() - t0:.0f}s)", flush=True)

    # test with the best weights
    state = torch.load(best_path, map_location=device)
    model.load_state_dict(state["model"])
    test_mae, test_rmse = score(model, test_dl, device)
    if rank == 0:
        print(f"best epoch {state['epoch']}: test MAE {test_mae:.4f} RMSE {test_rmse:.4f}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
