"""Dilated TCN over pre-cut sliding windows (store x family daily sales).

Cutting windows from the raw CSV takes ~15 minutes, so the windows are
materialised once per (context, horizon, stride) into a .npz next to the data.

    torchrun --nproc_per_node=4 08_tcn_sliding_windows.py \
        --csv /shared/data/favorita/train.csv --cache_dir /shared/data/favorita/cache
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.parametrizations import weight_norm
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default="/shared/data/favorita/train.csv")
    ap.add_argument("--cache_dir", default="/shared/data/favorita/cache")
    ap.add_argument("--ckpt_dir", default="/shared/ckpt/tcn_favorita")
    ap.add_argument("--context", type=int, default=180)
    ap.add_argument("--horizon", type=int, default=16)
    ap.add_argument("--stride", type=int, default=4)
    ap.add_argument("--val_days", type=int, default=64)
    ap.add_argument("--channels", type=int, default=96)
    ap.add_argument("--depth", type=int, default=7)
    ap.add_argument("--batch_size", type=int, default=512)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--epochs", type=int, default=30)
    return ap.parse_args()


def cut_windows(csv, context, horizon, stride, val_days):
    df = pd.read_csv(csv, usecols=["date", "store_nbr", "family", "sales", "onpromotion"],
                     parse_dates=["date"])
    df["key"] = df["store_nbr"].astype(str) + "|" + df["family"]
    sales = df.pivot_table(index="key", columns="date", values="sales").fillna(0).to_numpy(np.float32)
    promo = df.pivot_table(index="key", columns="date", values="onpromotion").fillna(0).to_numpy(np.float32)
    sales = np.log1p(np.clip(sales, 0, None))
    T = sales.shape[1]
    split = T - val_days
    mu = sales[:, :split].mean(1, keepdims=True)
    sd = sales[:, :split].std(1, keepdims=True) + 1e-2
    z = (sales - mu) / sd
    promo = np.log1p(promo)

    def windows(lo, hi):
        xs, ys = [], []
        for t in range(lo, hi - context - horizon + 1, stride):
            xs.append(np.stack([z[:, t:t + context], promo[:, t:t + context]], 1))
            ys.append(z[:, t + context:t + context + horizon])
        return np.concatenate(xs), np.concatenate(ys)

    x_tr, y_tr = windows(0, split)
    # validation windows forecast into the held-out days, context may reach back into train
    x_va, y_va = windows(split - context, T)
    return dict(x_tr=x_tr, y_tr=y_tr, x_va=x_va, y_va=y_va, mu=mu, sd=sd)


def load_windows(args):
    name = f"win_c{args.context}_h{args.horizon}_s{args.stride}_v{args.val_days}.npz"
    path = os.path.join(args.cache_dir, name)
    if not os.path.exists(path):
        arrays = cut_windows(args.csv, args.context, args.horizon, args.stride, args.val_days)
        os.makedirs(args.cache_dir, exist_ok=True)
        np.savez(path, **arrays)
    return dict(np.load(path))


class CausalConv(nn.Module):
    def __init__(self, c_in, c_out, k, d):
        super().__init__()
        self.pad = (k - 1) * d
        self.conv = weight_norm(nn.Conv1d(c_in, c_out, k, dilation=d))

    def forward(self, x):
        return self.conv(F.pad(x, (self.pad, 0)))


class TCN(nn.Module):
    def __init__(self, c_in, channels, depth, horizon, k=3, dropout=0.1):
        super().__init__()
        self.inp = nn.Conv1d(c_in, channels, 1)
        self.layers = nn.ModuleList([CausalConv(channels, channels, k, 2 ** i) for i in range(depth)])
        self.drop = nn.Dropout(dropout)
        self.head = nn.Sequential(nn.Linear(channels, channels), nn.GELU(), nn.Linear(channels, horizon))

    def forward(self, x):
        h = self.inp(x)
        for conv in self.layers:
            h = h + self.drop(F.gelu(conv(h)))
        return self.head(h[..., -1])


@torch.no_grad()
def validate(model, x_va, y_va, rank, world, device, bs=4096):
    model.eval()
    idx = np.arange(rank, len(x_va), world)
    s = torch.zeros(3, dtype=torch.float64, device=device)
    for b in range(0, len(idx), bs):
        j = idx[b:b + bs]
        x = torch.from_numpy(x_va[j]).to(device)
        y = torch.from_numpy(y_va[j]).to(device)
        p = model(x)
        s[0] += F.mse_loss(p, y, reduction="sum").double()
        s[1] += (p - y).abs().sum().double()
        s[2] += y.numel()
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[2]).item(), (s[1] / s[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    t0 = time.time()
    data = load_windows(args)
    if rank == 0:
        print(f"windows: train {len(data['x_tr'])} val {len(data['x_va'])} ({time.time() - t0:.0f}s)")

    train = TensorDataset(torch.from_numpy(data["x_tr"]), torch.from_numpy(data["y_tr"]))
    sampler = DistributedSampler(train, shuffle=True, drop_last=True)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                        num_workers=2, pin_memory=True)

    model = TCN(data["x_tr"].shape[1], args.channels, args.depth, args.horizon).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    best = float("inf")
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t_ep = time.time()
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sched.step()
        mse, mae = validate(model.module, data["x_va"], data["y_va"], rank, world, device)
        if rank == 0:
            print(f"epoch {epoch:02d} val_mse {mse:.4f} val_mae {mae:.4f} "
                  f"lr {sched.get_last_lr()[0]:.2e} {time.time() - t_ep:.0f}s", flush=True)
            if mse < best:
                best = mse
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "val_mse": mse,
                            "mu": data["mu"], "sd": data["sd"]},
                           os.path.join(args.ckpt_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
