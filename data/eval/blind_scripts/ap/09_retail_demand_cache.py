"""Daily store x item demand model (embeddings + MLP on lag features).

Feature engineering (lags, rolling means, calendar) takes ~20 min on the full history,
so the feature table is cached as parquet keyed by the feature settings.

    torchrun --nproc_per_node=8 09_retail_demand_cache.py --sales data/retail/sales_*.csv
"""
import argparse
import glob
import hashlib
import json
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

LAGS = [7, 14, 28, 56, 364]
WINDOWS = [7, 28, 91]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--sales", default="data/retail/sales_*.csv")
    p.add_argument("--cache-dir", default="/shared/cache/retail")
    p.add_argument("--valid-days", type=int, default=28)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--out", default="runs/demand_mlp")
    return p.parse_args()


def build_features(pattern):
    sales = pd.concat([pd.read_csv(f, parse_dates=["date"]) for f in sorted(glob.glob(pattern))], ignore_index=True)
    sales = sales.sort_values(["store_id", "item_id", "date"]).reset_index(drop=True)
    g = sales.groupby(["store_id", "item_id"])["units"]
    for lag in LAGS:
        sales[f"lag_{lag}"] = g.shift(lag)
    for w in WINDOWS:
        sales[f"rmean_{w}"] = g.transform(lambda s: s.shift(7).rolling(w, min_periods=1).mean())
    sales["dow"] = sales["date"].dt.dayofweek
    sales["month"] = sales["date"].dt.month
    sales["week"] = sales["date"].dt.isocalendar().week.astype(int)
    sales["promo"] = sales["promo"].fillna(0).astype(np.float32)
    sales = sales.dropna(subset=[f"lag_{LAGS[-2]}"]).reset_index(drop=True)
    for c in ["store_id", "item_id"]:
        sales[c + "_idx"] = pd.Categorical(sales[c]).codes
    return sales


def load_or_build(args):
    key = hashlib.md5(json.dumps({"lags": LAGS, "windows": WINDOWS, "src": args.sales}).encode()).hexdigest()[:10]
    path = os.path.join(args.cache_dir, f"features_{key}.parquet")
    if not os.path.exists(path):
        df = build_features(args.sales)
        os.makedirs(args.cache_dir, exist_ok=True)
        df.to_parquet(path, index=False)
    return pd.read_parquet(path)


class DemandDataset(Dataset):
    def __init__(self, df, num_cols):
        self.store = torch.tensor(df["store_id_idx"].values, dtype=torch.long)
        self.item = torch.tensor(df["item_id_idx"].values, dtype=torch.long)
        self.cal = torch.tensor(df[["dow", "month"]].values, dtype=torch.long)
        self.x = torch.tensor(np.log1p(df[num_cols].fillna(0).clip(lower=0).values), dtype=torch.float32)
        self.y = torch.tensor(np.log1p(df["units"].clip(lower=0).values), dtype=torch.float32)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.store[i], self.item[i], self.cal[i], self.x[i], self.y[i]


class DemandNet(nn.Module):
    def __init__(self, n_store, n_item, n_num):
        super().__init__()
        self.store = nn.Embedding(n_store, 16)
        self.item = nn.Embedding(n_item, 32)
        self.dow = nn.Embedding(7, 4)
        self.month = nn.Embedding(13, 4)
        d = 16 + 32 + 4 + 4 + n_num
        self.mlp = nn.Sequential(nn.Linear(d, 512), nn.ReLU(), nn.Dropout(0.1),
                                 nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 1))

    def forward(self, store, item, cal, x):
        h = torch.cat([self.store(store), self.item(item), self.dow(cal[:, 0]), self.month(cal[:, 1]), x], 1)
        return self.mlp(h).squeeze(1)


def evaluate(model, loader, device):
    net = model.module
    net.eval()
    # sums of |err| and units in the original scale, for WAPE
    acc = torch.zeros(3, device=device, dtype=torch.float64)
    with torch.no_grad():
        for store, item, cal, x, y in loader:
            pred = net(store.to(device), item.to(device), cal.to(device), x.to(device))
            y = y.to(device)
            units, units_hat = torch.expm1(y), torch.expm1(pred).clamp(min=0)
            acc[0] += (units - units_hat).abs().sum().double()
            acc[1] += units.sum().double()
            acc[2] += ((pred - y) ** 2).sum().double()
    dist.all_reduce(acc)
    n = torch.tensor(len(loader.dataset), device=device, dtype=torch.float64)
    dist.all_reduce(n)
    return (acc[0] / acc[1]).item(), (acc[2] / n).sqrt().item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    df = load_or_build(args)
    num_cols = [c for c in df.columns if c.startswith(("lag_", "rmean_"))] + ["promo"]
    cutoff = df["date"].max() - pd.Timedelta(days=args.valid_days)
    train_df, valid_df = df[df["date"] <= cutoff], df[df["date"] > cutoff]
    n_store, n_item = int(df["store_id_idx"].max()) + 1, int(df["item_id_idx"].max()) + 1
    if rank == 0:
        print(f"features: {len(df):,} rows, train {len(train_df):,}, valid {len(valid_df):,}, "
              f"{n_store} stores, {n_item} items", flush=True)

    train_ds, valid_ds = DemandDataset(train_df, num_cols), DemandDataset(valid_df, num_cols)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=8, pin_memory=True, persistent_workers=True)
    # strided shard of the validation days, every row scored exactly once
    valid_shard = Subset(valid_ds, range(rank, len(valid_ds), world_size))
    valid_loader = DataLoader(valid_shard, batch_size=16384, num_workers=4)

    model = DDP(DemandNet(n_store, n_item, len(num_cols)).to(device), device_ids=[local_rank])
    lr = args.lr * (world_size ** 0.5)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    loss_fn = nn.HuberLoss(delta=1.0)

    os.makedirs(args.out, exist_ok=True)
    best_wape = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for step, (store, item, cal, x, y) in enumerate(train_loader):
            store, item, cal = store.to(device, non_blocking=True), item.to(device, non_blocking=True), cal.to(device, non_blocking=True)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = loss_fn(model(store, item, cal, x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sched.step()

        wape, rmsle = evaluate(model, valid_loader, device)
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}  valid WAPE {wape:.4f}  RMSLE {rmsle:.4f}", flush=True)
            if wape < best_wape:
                best_wape = wape
                torch.save({"state_dict": model.module.state_dict(), "num_cols": num_cols,
                            "n_store": n_store, "n_item": n_item, "epoch": epoch},
                           os.path.join(args.out, "demand_best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
