"""Temporal conv net for daily store x SKU unit sales.

Trains on sliding windows cut from the sales panel (one row per series/day),
evaluates with a rolling-origin backtest over the last weeks of history.

    torchrun --nproc_per_node=8 01_tcn_store_sku.py --data /data/retail/sales_daily.parquet
"""
import argparse
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


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/retail/sales_daily.parquet")
    p.add_argument("--out_dir", default="runs/tcn_store_sku")
    p.add_argument("--context", type=int, default=112)
    p.add_argument("--horizon", type=int, default=28)
    p.add_argument("--n_origins", type=int, default=4)
    p.add_argument("--channels", type=int, default=64)
    p.add_argument("--levels", type=int, default=6)
    p.add_argument("--kernel", type=int, default=3)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--global_batch_size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=17)
    return p.parse_args()


def load_panel(path):
    df = pd.read_parquet(path, columns=["store_id", "item_id", "date", "units"])
    df["series"] = df["store_id"].astype(str) + "_" + df["item_id"].astype(str)
    panel = df.pivot_table(index="series", columns="date", values="units", aggfunc="sum")
    panel = panel.sort_index().sort_index(axis=1).fillna(0.0)
    return panel.index.to_numpy(), panel.to_numpy(dtype=np.float32)


class WindowDataset(Dataset):
    def __init__(self, values, scale, context, horizon, end, stride=7):
        self.values = values
        self.scale = scale
        self.context = context
        self.horizon = horizon
        span = context + horizon
        starts = np.arange(0, end - span + 1, stride)
        s_idx, t_idx = np.meshgrid(np.arange(values.shape[0]), starts, indexing="ij")
        self.index = np.stack([s_idx.ravel(), t_idx.ravel()], axis=1)

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        s, t = self.index[i]
        w = self.values[s, t:t + self.context + self.horizon] / self.scale[s]
        x = torch.from_numpy(w[:self.context].copy())
        y = torch.from_numpy(w[self.context:].copy())
        return x.unsqueeze(0), y


class TemporalBlock(nn.Module):
    def __init__(self, c_in, c_out, kernel, dilation, dropout):
        super().__init__()
        self.pad = (kernel - 1) * dilation
        self.conv1 = nn.Conv1d(c_in, c_out, kernel, dilation=dilation)
        self.bn1 = nn.BatchNorm1d(c_out)
        self.conv2 = nn.Conv1d(c_out, c_out, kernel, dilation=dilation)
        self.bn2 = nn.BatchNorm1d(c_out)
        self.drop = nn.Dropout(dropout)
        self.skip = nn.Conv1d(c_in, c_out, 1) if c_in != c_out else nn.Identity()

    def forward(self, x):
        h = F.pad(x, (self.pad, 0))
        h = self.drop(F.gelu(self.bn1(self.conv1(h))))
        h = F.pad(h, (self.pad, 0))
        h = self.drop(F.gelu(self.bn2(self.conv2(h))))
        return h + self.skip(x)


class TCNForecaster(nn.Module):
    def __init__(self, channels, levels, kernel, dropout, horizon):
        super().__init__()
        blocks = []
        c_in = 1
        for i in range(levels):
            blocks.append(TemporalBlock(c_in, channels, kernel, 2 ** i, dropout))
            c_in = channels
        self.tcn = nn.Sequential(*blocks)
        self.head = nn.Linear(channels, horizon)

    def forward(self, x):
        h = self.tcn(x)
        return self.head(h[:, :, -1])


@torch.no_grad()
def backtest(model, values, scale, context, horizon, n_origins, rank, world_size, device):
    model.eval()
    n_series, T = values.shape
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # |err|, |y|, sq err
    mine = np.arange(rank, n_series, world_size)
    for k in range(n_origins, 0, -1):
        cutoff = T - k * horizon
        for chunk in np.array_split(mine, max(1, len(mine) // 2048)):
            if len(chunk) == 0:
                continue
            ctx = values[chunk, cutoff - context:cutoff] / scale[chunk, None]
            x = torch.from_numpy(ctx).to(device).unsqueeze(1)
            pred = model(x).clamp_min(0).double().cpu().numpy() * scale[chunk, None]
            y = values[chunk, cutoff:cutoff + horizon]
            sums[0] += float(np.abs(pred - y).sum())
            sums[1] += float(np.abs(y).sum())
            sums[2] += float(((pred - y) ** 2).sum())
    dist.all_reduce(sums)
    n_points = n_series * n_origins * horizon
    model.train()
    return {"wape": (sums[0] / sums[1].clamp_min(1e-8)).item(),
            "rmse": math.sqrt(sums[2].item() / n_points)}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    series, values = load_panel(args.data)
    T = values.shape[1]
    train_end = T - args.n_origins * args.horizon
    # mean scaling per series on the training range only
    scale = np.maximum(values[:, :train_end].mean(axis=1), 1.0).astype(np.float32)

    train_ds = WindowDataset(values, scale, args.context, args.horizon, train_end)
    per_gpu = args.global_batch_size // world_size
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=per_gpu, sampler=sampler,
                        num_workers=args.workers, pin_memory=True, drop_last=True,
                        persistent_workers=args.workers > 0)

    model = TCNForecaster(args.channels, args.levels, args.kernel, args.dropout, args.horizon)
    model = DDP(model.to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    total_steps = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total_steps,
                                                pct_start=0.05)

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "config.json"), "w") as f:
            json.dump(vars(args) | {"world_size": world_size, "n_series": len(series)}, f, indent=2)
        print(f"{len(series)} series, {T} days, {len(train_ds)} windows, "
              f"{len(loader)} steps/epoch at {per_gpu}/gpu")

    best = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        run_loss = torch.zeros(2, device=device)
        for x, y in loader:
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            loss = F.l1_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            run_loss[0] += loss.detach()
            run_loss[1] += 1
        dist.all_reduce(run_loss)
        metrics = backtest(model.module, values, scale, args.context, args.horizon,
                           args.n_origins, rank, world_size, device)
        if rank == 0:
            print(f"epoch {epoch:3d} loss {run_loss[0].item() / run_loss[1].item():.4f} "
                  f"wape {metrics['wape']:.4f} rmse {metrics['rmse']:.3f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            state = {"model": model.module.state_dict(), "epoch": epoch,
                     "metrics": metrics, "args": vars(args)}
            torch.save(state, os.path.join(args.out_dir, "last.pt"))
            if metrics["wape"] < best:
                best = metrics["wape"]
                torch.save(state, os.path.join(args.out_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
