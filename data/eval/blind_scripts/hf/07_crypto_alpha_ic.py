"""Cross-sectional crypto alpha model (perp futures, hourly).

Features are precomputed per (hour, symbol): returns over several lookbacks,
funding rate, basis, open-interest change, order-book imbalance. Target is the
next 4h return, demeaned across the universe. Model selection uses the rank IC
on the validation period.

    torchrun --nproc_per_node=4 07_crypto_alpha_ic.py --features /data/crypto/features_1h.parquet
"""
import argparse
import json
import os
import random
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from scipy.stats import spearmanr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--features", required=True)
    ap.add_argument("--train-end", default="2023-06-30")
    ap.add_argument("--val-end", default="2023-12-31")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--dropout", type=float, default=0.2)
    ap.add_argument("--batch-size", type=int, default=2048)
    ap.add_argument("--epochs", type=int, default=25)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", default="artifacts/crypto_alpha")
    ap.add_argument("--seed", type=int, default=7)
    return ap.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class AlphaNet(nn.Module):
    def __init__(self, n_in, hidden, depth, dropout):
        super().__init__()
        layers, d = [], n_in
        for _ in range(depth):
            layers += [nn.Linear(d, hidden), nn.LayerNorm(hidden), nn.GELU(), nn.Dropout(dropout)]
            d = hidden
        layers.append(nn.Linear(d, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, x):
        return self.mlp(x).squeeze(-1)


def build_split(df, feats, lo, hi):
    part = df[(df.ts > lo) & (df.ts <= hi)]
    x = torch.tensor(part[feats].to_numpy(np.float32))
    y = torch.tensor(part["target"].to_numpy(np.float32))
    t = torch.tensor(part["hour_id"].to_numpy(np.int64))
    return TensorDataset(x, y, t)


def rank_ic(pred, target, hour):
    """mean over hours of the Spearman correlation between prediction and target."""
    frame = pd.DataFrame({"p": pred, "y": target, "h": hour})
    ics = [spearmanr(g.p, g.y).correlation for _, g in frame.groupby("h") if len(g) >= 5]
    ics = [v for v in ics if np.isfinite(v)]
    return float(np.mean(ics)) if ics else 0.0


@torch.no_grad()
def predict(model, loader, device):
    model.eval()
    preds, ys, hours = [], [], []
    for x, y, h in loader:
        preds.append(model(x.to(device, non_blocking=True)).float().cpu())
        ys.append(y)
        hours.append(h)
    return torch.cat(preds).numpy(), torch.cat(ys).numpy(), torch.cat(hours).numpy()


def main():
    args = parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    seed_everything(args.seed)

    df = pd.read_parquet(args.features)
    df["ts"] = pd.to_datetime(df["ts"], utc=True)
    df = df.sort_values(["ts", "symbol"]).reset_index(drop=True)
    df["hour_id"] = df["ts"].rank(method="dense").astype(np.int64)
    feats = [c for c in df.columns if c.startswith("x_")]
    df[feats] = df[feats].fillna(0.0).clip(-5, 5)
    df["target"] = df["fwd_ret_4h"] - df.groupby("ts")["fwd_ret_4h"].transform("mean")
    df = df.dropna(subset=["target"])

    t0, t1, t2 = df.ts.min() - pd.Timedelta(hours=1), pd.Timestamp(args.train_end, tz="UTC"), pd.Timestamp(args.val_end, tz="UTC")
    train_ds = build_split(df, feats, t0, t1)
    val_ds = build_split(df, feats, t1, t2)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, drop_last=True,
                              num_workers=2, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=8192, sampler=val_sampler, num_workers=2, pin_memory=True)

    model = DDP(AlphaNet(len(feats), args.hidden, args.depth, args.dropout).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_loader))
    loss_fn = nn.MSELoss()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(feats)} features, train={len(train_ds)} val={len(val_ds)} world={world}", flush=True)

    best_ic, history = -1.0, []
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        total = torch.zeros(2, device=device)
        for x, y, _ in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = loss_fn(model(x), y * 100.0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(total)
        train_loss = (total[0] / total[1]).item()

        pred, target, hour = predict(model.module, val_loader, device)
        val_ic = rank_ic(pred, target, hour)
        val_mse = float(np.mean((pred - target * 100.0) ** 2))

        if rank == 0:
            history.append({"epoch": epoch, "train_loss": train_loss, "val_mse": val_mse, "val_ic": val_ic})
            print(f"epoch {epoch:02d} train {train_loss:.4f} val_mse {val_mse:.4f} val_ic {val_ic:.4f} "
                  f"({time.time() - tic:.0f}s)", flush=True)
            if val_ic > best_ic:
                best_ic = val_ic
                torch.save({"model": model.module.state_dict(), "features": feats, "epoch": epoch,
                            "val_ic": val_ic}, os.path.join(args.out, "best.pt"))
            with open(os.path.join(args.out, "history.json"), "w") as fh:
                json.dump(history, fh, indent=1)
        dist.barrier()

    if rank == 0:
        print(f"best val IC {best_ic:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
