"""Global model over per-asset datasets (commodity futures, continuous contracts).

Each rank owns a disjoint set of assets: it builds (or reuses) the feature cache
for those assets only and trains on them. Assets have very different history
lengths, so the ranks see different numbers of batches per epoch; DDP's Join
context handles the ranks that run out early.

    torchrun --standalone --nproc_per_node=4 17_per_asset_shards_join.py \
        --meta /data/cmdty/meta.json --raw /data/cmdty/raw --cache /data/cmdty/cache
"""
import argparse
import json
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset

FEATURES = ["ret_1", "ret_5", "ret_20", "ret_60", "vol_20", "carry", "basis_mom", "cot_net", "oi_chg"]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--meta", required=True, help="json: {ticker: {sector: ..., ...}}")
    p.add_argument("--raw", required=True)
    p.add_argument("--cache", required=True)
    p.add_argument("--lookback", type=int, default=64)
    p.add_argument("--val-start", default="2020-01-01")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--out", default="runs/cmdty_global")
    return p.parse_args()


def build_features(raw_csv):
    df = pd.read_csv(raw_csv, parse_dates=["date"]).sort_values("date")
    px = np.log(df["settle_adj"])
    out = pd.DataFrame({"date": df["date"]})
    for n in (1, 5, 20, 60):
        out[f"ret_{n}"] = px.diff(n)
    out["vol_20"] = out["ret_1"].rolling(20).std()
    for n in (1, 5, 20, 60):
        out[f"ret_{n}"] /= out["vol_20"] * np.sqrt(n) + 1e-8
    out["carry"] = np.log(df["front"] / df["second"]) * 365 / df["days_between"]
    out["basis_mom"] = out["carry"].diff(20)
    out["cot_net"] = (df["cot_long"] - df["cot_short"]) / df["open_interest"]
    out["oi_chg"] = np.log(df["open_interest"]).diff(5)
    out["target"] = (px.shift(-5) - px) / (out["vol_20"] * np.sqrt(5) + 1e-8)
    return out.dropna().reset_index(drop=True)


def cached_features(ticker, raw_dir, cache_dir):
    path = os.path.join(cache_dir, f"{ticker}.parquet")
    if not os.path.exists(path):
        feats = build_features(os.path.join(raw_dir, f"{ticker}.csv"))
        tmp = f"{path}.{os.getpid()}.tmp"
        feats.to_parquet(tmp)
        os.replace(tmp, path)
    return pd.read_parquet(path)


class AssetWindows(Dataset):
    def __init__(self, df, asset_id, lookback):
        self.x = torch.from_numpy(df[FEATURES].to_numpy(np.float32).clip(-8, 8))
        self.y = torch.from_numpy(df["target"].to_numpy(np.float32).clip(-5, 5))
        self.asset_id, self.lookback = asset_id, lookback

    def __len__(self):
        return max(0, len(self.y) - self.lookback)

    def __getitem__(self, i):
        t = i + self.lookback
        return self.x[t - self.lookback : t], self.asset_id, self.y[t - 1]


class GlobalModel(nn.Module):
    def __init__(self, n_assets, n_sectors, sector_of_asset, hidden=96):
        super().__init__()
        self.register_buffer("sector_of_asset", torch.tensor(sector_of_asset, dtype=torch.long))
        self.asset_emb = nn.Embedding(n_assets, 8)
        self.sector_emb = nn.Embedding(n_sectors, 4)
        self.gru = nn.GRU(len(FEATURES) + 12, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x, asset):
        e = torch.cat([self.asset_emb(asset), self.sector_emb(self.sector_of_asset[asset])], -1)
        h, _ = self.gru(torch.cat([x, e.unsqueeze(1).expand(-1, x.size(1), -1)], -1))
        return self.head(h[:, -1]).squeeze(-1)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    with open(args.meta) as fh:
        meta = json.load(fh)
    tickers = sorted(meta)  # the universe and its ids are the same on every rank
    sectors = sorted({meta[t]["sector"] for t in tickers})
    sector_of_asset = [sectors.index(meta[t]["sector"]) for t in tickers]
    mine = [(i, t) for i, t in enumerate(tickers) if i % world == rank]

    os.makedirs(args.cache, exist_ok=True)
    train_parts, val_parts = [], []
    for aid, t in mine:
        df = cached_features(t, args.raw, args.cache)
        cut = df["date"] >= pd.Timestamp(args.val_start)
        train_parts.append(AssetWindows(df[~cut], aid, args.lookback))
        val_parts.append(AssetWindows(df[cut], aid, args.lookback))
    train_ds, val_ds = ConcatDataset(train_parts), ConcatDataset(val_parts)
    train_loader = DataLoader(train_ds, args.batch_size, shuffle=True, num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, 1024, shuffle=False, num_workers=2)
    print(f"[rank {rank}] assets={len(mine)} train={len(train_ds)} val={len(val_ds)} batches={len(train_loader)}", flush=True)

    model = GlobalModel(len(tickers), len(sectors), sector_of_asset).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        local = torch.zeros(2, device=device, dtype=torch.float64)
        with Join([model]):
            for x, aid, y in train_loader:
                x, aid, y = x.to(device, non_blocking=True), aid.to(device, non_blocking=True), y.to(device, non_blocking=True)
                loss = nn.functional.mse_loss(model(x, aid), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                local += torch.stack([loss.detach().double() * len(y), torch.tensor(float(len(y)), device=device, dtype=torch.float64)])
        sched.step()

        # per-asset validation on the rank that owns the asset, without DDP in the loop
        net = model.module.eval()
        preds = {}
        with torch.no_grad():
            for x, aid, y in val_loader:
                p = net(x.to(device), aid.to(device)).cpu().numpy()
                for a, pi, yi in zip(aid.numpy(), p, y.numpy()):
                    preds.setdefault(int(a), []).append((pi, yi))
        summary = {}
        for a, pairs in preds.items():
            p, y = map(np.array, zip(*pairs))
            pos = np.sign(p)
            summary[tickers[a]] = {"ic": float(np.corrcoef(p, y)[0, 1]) if len(p) > 2 else float("nan"),
                                   "sharpe": float(np.mean(pos * y) / (np.std(pos * y) + 1e-12) * np.sqrt(52))}
        dist.all_reduce(local)
        gathered = [None] * world
        dist.all_gather_object(gathered, summary)

        if rank == 0:
            merged = {k: v for part in gathered for k, v in part.items()}
            sharpes = [v["sharpe"] for v in merged.values()]
            print(f"epoch {epoch} train_mse {(local[0] / local[1]).item():.4f} assets={len(merged)} "
                  f"median_sharpe {np.median(sharpes):.2f} ({time.time() - t0:.0f}s)", flush=True)
            with open(os.path.join(args.out, f"val_epoch{epoch:02d}.json"), "w") as fh:
                json.dump(merged, fh, indent=1)
            torch.save({"model": model.module.state_dict(), "tickers": tickers, "sectors": sectors, "epoch": epoch},
                       os.path.join(args.out, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
