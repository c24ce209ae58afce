"""TSMixer with auxiliary (static + future-known) features for store-item sales.

    torchrun --nproc_per_node=4 16_tsmixer_sales.py --data /data/store_item/train.csv
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def options():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/store_item/train.csv")
    p.add_argument("--out", default="runs/tsmixer_sales")
    p.add_argument("--L", type=int, default=364)
    p.add_argument("--H", type=int, default=90)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--ff", type=int, default=256)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--bs", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--origins", type=int, default=3)
    return p.parse_args()


class MixerBlock(nn.Module):
    def __init__(self, T, C, ff, drop):
        super().__init__()
        self.norm_t = nn.LayerNorm(C)
        self.time = nn.Sequential(nn.Linear(T, T), nn.ReLU(), nn.Dropout(drop))
        self.norm_f = nn.LayerNorm(C)
        self.feat = nn.Sequential(nn.Linear(C, ff), nn.ReLU(), nn.Dropout(drop), nn.Linear(ff, C), nn.Dropout(drop))

    def forward(self, x):  # (B, T, C)
        x = x + self.time(self.norm_t(x).transpose(1, 2)).transpose(1, 2)
        return x + self.feat(self.norm_f(x))


class TSMixerExt(nn.Module):
    def __init__(self, L, H, n_fut, n_store, n_item, hidden, ff, blocks, drop):
        super().__init__()
        self.H = H
        self.store = nn.Embedding(n_store, 8)
        self.item = nn.Embedding(n_item, 16)
        self.time_proj = nn.Linear(L, H)
        self.inp = nn.Linear(1 + n_fut, hidden)
        self.fut = nn.Linear(n_fut + 24, hidden)
        self.mix = nn.ModuleList([MixerBlock(H, 2 * hidden, ff, drop) for _ in range(blocks)])
        self.out = nn.Linear(2 * hidden, 1)

    def forward(self, y_past, x_past, x_fut, store, item):
        past = torch.cat([y_past.unsqueeze(-1), x_past], -1)                 # (B, L, 1+F)
        past = self.time_proj(past.transpose(1, 2)).transpose(1, 2)          # (B, H, 1+F)
        st = torch.cat([self.store(store), self.item(item)], -1)[:, None].expand(-1, self.H, -1)
        fut = torch.cat([x_fut, st], -1)
        z = torch.cat([self.inp(past), self.fut(fut)], -1)
        for blk in self.mix:
            z = blk(z)
        return self.out(z).squeeze(-1)


class SalesWindows(Dataset):
    def __init__(self, y, feats, store, item, origins, L, H, scale):
        self.y, self.f, self.store, self.item = y, feats, store, item
        self.idx = [(s, o) for o in origins for s in range(len(y))]
        self.L, self.H, self.scale = L, H, scale

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, i):
        s, o = self.idx[i]
        L, H = self.L, self.H
        sc = self.scale[s]
        return (torch.from_numpy(self.y[s, o - L:o] / sc), torch.from_numpy(self.f[o - L:o]),
                torch.from_numpy(self.f[o:o + H]), self.store[s], self.item[s],
                torch.from_numpy(self.y[s, o:o + H] / sc), torch.tensor(sc))


def calendar(dates):
    d = pd.DatetimeIndex(dates)
    return np.column_stack([np.sin(2 * np.pi * d.dayofweek / 7), np.cos(2 * np.pi * d.dayofweek / 7),
                            np.sin(2 * np.pi * d.dayofyear / 365.25), np.cos(2 * np.pi * d.dayofyear / 365.25),
                            d.month / 12.0]).astype(np.float32)


def evaluate(model, loader, dev):
    model.eval()
    se = ae = n = 0.0
    with torch.no_grad():
        for yp, xp, xf, st, it, yt, sc in loader:
            yp, xp, xf, st, it, yt, sc = (t.to(dev, non_blocking=True) for t in (yp, xp, xf, st, it, yt, sc))
            pred = model(yp, xp, xf, st, it).clamp(min=0) * sc[:, None]
            true = yt * sc[:, None]
            se += ((pred - true) ** 2).sum().item()
            ae += (pred - true).abs().sum().item()
            n += true.numel()
    stats = torch.tensor([se, ae, n], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    se, ae, n = stats.tolist()
    model.train()
    return math.sqrt(se / n), ae / n


def main():
    a = options()
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(11)

    df = pd.read_csv(a.data, parse_dates=["date"])
    wide = df.pivot_table(index=["store", "item"], columns="date", values="sales").sort_index()
    y = wide.to_numpy(np.float32)
    store = wide.index.get_level_values(0).to_numpy() - 1
    item = wide.index.get_level_values(1).to_numpy() - 1
    feats = calendar(wide.columns)
    T = y.shape[1]
    val_origins = [T - a.H * (k + 1) for k in reversed(range(a.origins))]
    t_end = val_origins[0]
    scale = np.maximum(y[:, :t_end].mean(1), 1.0).astype(np.float32)

    train_ds = SalesWindows(y, feats, store, item, range(a.L, t_end - a.H + 1, 7), a.L, a.H, scale)
    val_ds = SalesWindows(y, feats, store, item, val_origins, a.L, a.H, scale)
    tr_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=a.bs, sampler=tr_sampler, num_workers=8,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)),
                        batch_size=1024, num_workers=4)

    model = TSMixerExt(a.L, a.H, feats.shape[1], int(store.max()) + 1, int(item.max()) + 1,
                       a.hidden, a.ff, a.blocks, a.dropout).to(dev)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=a.epochs)
    if rank == 0:
        os.makedirs(a.out, exist_ok=True)

    best = float("inf")
    for ep in range(a.epochs):
        tr_sampler.set_epoch(ep)
        t0, run = time.time(), 0.0
        for yp, xp, xf, st, it, yt, sc in train_dl:
            yp, xp, xf, st, it, yt = (t.to(dev, non_blocking=True) for t in (yp, xp, xf, st, it, yt))
            loss = F.mse_loss(model(yp, xp, xf, st, it), yt)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            run += loss.item()
        sched.step()
        rmse, mae = evaluate(model, val_dl, dev)
        if rank == 0:
            print(f"ep {ep:02d} train {run / len(train_dl):.4f} | val rmse {rmse:.3f} mae {mae:.3f} "
                  f"| {time.time() - t0:.0f}s", flush=True)
            if mae < best:
                torch.save({"model": model.module.state_dict(), "scale": scale, "epoch": ep},
                           os.path.join(a.out, "best.pt"))
        best = min(best, mae)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
