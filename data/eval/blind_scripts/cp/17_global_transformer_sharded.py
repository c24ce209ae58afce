"""Global Transformer forecaster with learned per-series embeddings.

The panel (~1.8M item/store series) is stored as one parquet file per store,
so each rank reads a disjoint set of store files instead of the full panel;
windows are drawn at random from the rank's series.

    torchrun --nnodes=1 --nproc_per_node=8 17_global_transformer_sharded.py \
        --parts "/data/favorita/parts/store=*.parquet"
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
from torch.utils.data import DataLoader, Dataset

QS = torch.tensor([0.1, 0.5, 0.9])


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--parts", default="/data/favorita/parts/store=*.parquet")
    p.add_argument("--out", default="runs/global_tf")
    p.add_argument("--L", type=int, default=56)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--id_dim", type=int, default=32)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--steps_per_epoch", type=int, default=2000)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--holdout_days", type=int, default=16)
    return p.parse_args()


def load_shard(files):
    df = pd.concat([pd.read_parquet(f, columns=["store_nbr", "item_nbr", "date", "unit_sales", "onpromotion"])
                    for f in files], ignore_index=True)
    df["series"] = df.store_nbr.astype(str) + "_" + df.item_nbr.astype(str)
    sales = df.pivot_table(index="series", columns="date", values="unit_sales", aggfunc="sum").fillna(0)
    promo = df.pivot_table(index="series", columns="date", values="onpromotion", aggfunc="max").fillna(0)
    promo = promo.reindex(index=sales.index, columns=sales.columns, fill_value=0)
    y = np.log1p(sales.to_numpy(np.float32).clip(min=0))
    return y, promo.to_numpy(np.float32), list(sales.index), pd.DatetimeIndex(sales.columns)


class RandomWindows(Dataset):
    """A fixed number of random (series, origin) windows per epoch."""

    def __init__(self, y, promo, dow, t_hi, L, H, n, seed):
        self.y, self.promo, self.dow = y, promo, dow
        self.t_hi, self.L, self.H, self.n = t_hi, L, H, n
        self.rng = np.random.default_rng(seed)

    def __len__(self):
        return self.n

    def __getitem__(self, _):
        s = int(self.rng.integers(len(self.y)))
        t = int(self.rng.integers(self.L, self.t_hi - self.H + 1))
        return window(self.y, self.promo, self.dow, s, t, self.L, self.H)


class OriginWindows(Dataset):
    def __init__(self, y, promo, dow, origin, L, H):
        self.args = (y, promo, dow)
        self.origin, self.L, self.H = origin, L, H

    def __len__(self):
        return len(self.args[0])

    def __getitem__(self, s):
        return window(*self.args, s, self.origin, self.L, self.H)


def window(y, promo, dow, s, t, L, H):
    yp = y[s, t - L:t]
    level = yp.mean() + 1e-3
    feats = np.column_stack([promo[s, t - L:t + H], dow[t - L:t + H]])
    return (torch.from_numpy(yp / level), torch.from_numpy(feats.astype(np.float32)), s,
            torch.from_numpy(y[s, t:t + H] / level), torch.tensor(level, dtype=torch.float32))


class GlobalTF(nn.Module):
    def __init__(self, n_series, L, H, d, layers, heads, id_dim, n_feat=8):
        super().__init__()
        self.L, self.H = L, H
        self.series_emb = nn.Embedding(n_series, id_dim)
        self.inp = nn.Linear(1 + n_feat + id_dim, d)
        self.pos = nn.Parameter(torch.zeros(1, L + H, d))
        enc = nn.TransformerEncoderLayer(d, heads, 4 * d, 0.1, batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(enc, layers)
        self.head = nn.Linear(d, len(QS))

    def forward(self, y_past, feats, sid):
        B = y_past.shape[0]
        y_in = torch.cat([y_past, y_past.new_zeros(B, self.H)], 1).unsqueeze(-1)
        e = self.series_emb(sid)[:, None].expand(-1, self.L + self.H, -1)
        h = self.inp(torch.cat([y_in, feats, e], -1)) + self.pos
        return self.head(self.body(h)[:, self.L:])       # (B, H, Q)


def pinball(pred, y):
    q = QS.to(pred.device).view(1, 1, -1)
    e = y.unsqueeze(-1) - pred
    return torch.maximum(q * e, (q - 1) * e).mean()


@torch.no_grad()
def evaluate(model, loader, dev):
    model.eval()
    acc = torch.zeros(3, device=dev, dtype=torch.float64)
    for yp, f, sid, yt, lvl in loader:
        yp, f, sid, yt, lvl = (t.to(dev) for t in (yp, f, sid, yt, lvl))
        pred = model(yp, f, sid)
        med = pred[..., 1] * lvl[:, None]
        true = yt * lvl[:, None]
        acc += torch.stack([pinball(pred, yt).double() * yt.numel(),
                            (torch.expm1(med) - torch.expm1(true)).abs().sum().double(),
                            torch.tensor(float(yt.numel()), device=dev, dtype=torch.float64)])
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    a = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(5)

    files = sorted(glob.glob(a.parts))
    my_files = files[rank::world]
    y, promo, series_ids, dates = load_shard(my_files)
    dow = np.eye(7, dtype=np.float32)[dates.dayofweek]
    T = y.shape[1]
    t_val = T - 2 * a.holdout_days
    t_test = T - a.holdout_days
    print(f"[rank {rank}] {len(my_files)} stores, {len(series_ids)} series, {T} days", flush=True)

    train_ds = RandomWindows(y, promo, dow, t_val, a.L, a.H, a.steps_per_epoch * a.batch, seed=1000 + rank)
    train_dl = DataLoader(train_ds, batch_size=a.batch, num_workers=6, pin_memory=True,
                          worker_init_fn=lambda w: setattr(torch.utils.data.get_worker_info().dataset, "rng",
                                                           np.random.default_rng(1000 * (rank + 1) + w)))
    val_dl = DataLoader(OriginWindows(y, promo, dow, t_val, a.L, a.H), batch_size=2048, num_workers=4)
    test_dl = DataLoader(OriginWindows(y, promo, dow, t_test, a.L, a.H), batch_size=2048, num_workers=4)

    model = GlobalTF(len(series_ids), a.L, a.H, a.d, a.layers, a.heads, a.id_dim).to(dev)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, a.lr, total_steps=a.epochs * len(train_dl))
    os.makedirs(a.out, exist_ok=True)

    best = float("inf")
    for ep in range(a.epochs):
        t0, tot = time.time(), 0.0
        for yp, f, sid, yt, _ in train_dl:
            yp, f, sid, yt = (t.to(dev, non_blocking=True) for t in (yp, f, sid, yt))
            loss = pinball(model(yp, f, sid), yt)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            tot += loss.item()
        val_q, val_mae = evaluate(model, val_dl, dev)
        if rank == 0:
            print(f"epoch {ep} train {tot / len(train_dl):.4f} val pinball {val_q:.4f} "
                  f"mae {val_mae:.3f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": ep,
                        "args": vars(a)}, os.path.join(a.out, "last.pt"))
        best = min(best, val_q)
    test_q, test_mae = evaluate(model, test_dl, dev)
    if rank == 0:
        print(f"best val pinball {best:.4f} | test pinball {test_q:.4f} mae {test_mae:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
