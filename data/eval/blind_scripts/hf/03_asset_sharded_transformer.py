"""Per-asset sequence transformer for next-day return sign.

Every rank reads only its own slice of the asset universe (one parquet file per
ticker), so the full panel never has to fit in a single process.

    torchrun --nproc_per_node=8 03_asset_sharded_transformer.py \
        --asset-dir /data/daily_bars --universe universe_sp500.txt
"""
import argparse
import glob
import logging
import math
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

log = logging.getLogger(__name__)

PRICE_FEATURES = ["ret_1d", "ret_5d", "ret_21d", "vol_21d", "log_dollar_vol", "hl_range", "gap"]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--asset-dir", required=True)
    p.add_argument("--universe", required=True)
    p.add_argument("--seq-len", type=int, default=60)
    p.add_argument("--train-end", default="2019-12-31")
    p.add_argument("--val-end", default="2021-12-31")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--ckpt", default="checkpoints/asset_tf.pt")
    return p.parse_args()


def load_assets(files):
    frames = []
    for f in files:
        df = pd.read_parquet(f)
        df["ticker"] = os.path.basename(f).replace(".parquet", "")
        frames.append(df)
    df = pd.concat(frames, ignore_index=True)
    df["date"] = pd.to_datetime(df["date"])
    df["target"] = (df.groupby("ticker")["ret_1d"].shift(-1) > 0).astype(np.float32)
    df = df.dropna(subset=PRICE_FEATURES)
    return df


class SequenceDataset(Dataset):
    def __init__(self, df, feature_cols, seq_len, start=None, end=None):
        self.seq_len = seq_len
        self.blocks, self.index = [], []
        for _, g in df.groupby("ticker"):
            g = g.sort_values("date")
            x = g[feature_cols].to_numpy(np.float32)
            x = (x - x.mean(0)) / (x.std(0) + 1e-6)
            y = g["target"].to_numpy(np.float32)
            dates = g["date"].to_numpy()
            b = len(self.blocks)
            self.blocks.append((torch.from_numpy(x), torch.from_numpy(y)))
            for t in range(seq_len, len(g) - 1):
                d = dates[t]
                if (start is None or d > np.datetime64(start)) and (end is None or d <= np.datetime64(end)):
                    self.index.append((b, t))

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        b, t = self.index[i]
        x, y = self.blocks[b]
        return x[t - self.seq_len + 1 : t + 1], y[t]


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, max_len=512):
        super().__init__()
        pe = torch.zeros(max_len, d_model)
        pos = torch.arange(max_len).unsqueeze(1)
        div = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(pos * div)
        pe[:, 1::2] = torch.cos(pos * div)
        self.register_buffer("pe", pe)

    def forward(self, x):
        return x + self.pe[: x.size(1)]


class AssetTransformer(nn.Module):
    def __init__(self, n_features, d_model, layers, heads, dropout=0.1):
        super().__init__()
        self.proj = nn.Linear(n_features, d_model)
        self.pos = PositionalEncoding(d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.head = nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, 1))

    def forward(self, x):
        h = self.encoder(self.pos(self.proj(x)))
        return self.head(h[:, -1]).squeeze(-1)


def run_epoch(model, loader, n_steps, device, optimizer=None):
    train = optimizer is not None
    model.train(train)
    stats = torch.zeros(3, device=device)
    it = iter(loader)
    with torch.set_grad_enabled(train):
        for _ in range(n_steps):
            x, y = next(it)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            loss = F.binary_cross_entropy_with_logits(logits, y)
            if train:
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
            stats += torch.stack([loss.detach() * len(y), ((logits > 0).float() == y).sum(), torch.tensor(float(len(y)), device=device)])
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR)

    with open(args.universe) as fh:
        universe = sorted(line.strip() for line in fh if line.strip())
    files = [os.path.join(args.asset_dir, f"{t}.parquet") for t in universe]
    files = [f for f in files if os.path.exists(f)]
    my_files = files[rank::world]
    df = load_assets(my_files)

    sector_dummies = pd.get_dummies(df["sector"], prefix="sec", dtype=np.float32)
    df = pd.concat([df, sector_dummies], axis=1)
    feature_cols = PRICE_FEATURES + list(sector_dummies.columns)

    train_ds = SequenceDataset(df, feature_cols, args.seq_len, end=args.train_end)
    val_ds = SequenceDataset(df, feature_cols, args.seq_len, start=args.train_end, end=args.val_end)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, drop_last=True, num_workers=4, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, shuffle=False, drop_last=True, num_workers=2)

    # shards hold different numbers of rows; all ranks run the same number of steps
    steps = torch.tensor([len(train_loader), len(val_loader)], device=device)
    dist.all_reduce(steps, op=dist.ReduceOp.MIN)
    train_steps, val_steps = steps.tolist()
    log.info("assets=%d (this rank %d) train_steps=%d val_steps=%d", len(files), len(my_files), train_steps, val_steps)

    torch.manual_seed(0)
    model = AssetTransformer(len(feature_cols), args.d_model, args.layers, args.heads).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    best = float("inf")
    for epoch in range(args.epochs):
        tr_loss, tr_acc = run_epoch(model, train_loader, train_steps, device, optimizer)
        va_loss, va_acc = run_epoch(model, val_loader, val_steps, device)
        scheduler.step()
        log.info("epoch %02d train %.4f/%.3f val %.4f/%.3f", epoch, tr_loss, tr_acc, va_loss, va_acc)
        if rank == 0 and va_loss < best:
            best = va_loss
            os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
            torch.save({"model": model.module.state_dict(), "features": feature_cols, "epoch": epoch}, args.ckpt)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
