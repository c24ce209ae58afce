"""Tabular regression (energy load forecasting features) with a residual MLP.

Ported from the tf.keras + MirroredStrategy version. Keeps the Keras-style metric
objects (update_state / result / reset_state) so the dashboards stay the same.

    torchrun --nnodes=1 --nproc_per_node=8 03_tabular_regression_metrics.py --config configs/load_mlp.yaml
"""
import argparse
import math
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

DEFAULTS = dict(
    train_path="data/load_train.parquet",
    target="load_mw",
    hidden=512,
    blocks=4,
    dropout=0.1,
    batch_size=1024,  # per replica
    lr=2e-3,
    weight_decay=1e-5,
    epochs=60,
    val_fraction=0.1,
    seed=7,
    out_dir="runs/load_mlp",
)


class FrameDataset(Dataset):
    def __init__(self, df, feature_cols, target, mean, std):
        x = df[feature_cols].to_numpy(np.float32)
        self.x = torch.from_numpy((x - mean) / std)
        self.y = torch.from_numpy(df[target].to_numpy(np.float32)).unsqueeze(1)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class ResBlock(nn.Module):
    def __init__(self, d, p):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU(), nn.Dropout(p), nn.Linear(d, d))

    def forward(self, x):
        return x + self.net(x)


class ResMLP(nn.Module):
    def __init__(self, n_in, hidden, blocks, dropout):
        super().__init__()
        self.inp = nn.Linear(n_in, hidden)
        self.blocks = nn.Sequential(*[ResBlock(hidden, dropout) for _ in range(blocks)])
        self.head = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.head(self.blocks(self.inp(x)))


class MeanMetric:
    def __init__(self, name):
        self.name = name
        self.reset_state()

    def reset_state(self):
        self.total = 0.0
        self.count = 0

    def update_state(self, values):
        values = values.detach()
        self.total += float(values.sum())
        self.count += values.numel()

    def result(self):
        t = torch.tensor([self.total, self.count], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(t)
        return (t[0] / max(t[1].item(), 1.0)).item()


class MeanSquaredError(MeanMetric):
    def update_state(self, pred, y):
        super().update_state((pred - y) ** 2)


class MeanAbsoluteError(MeanMetric):
    def update_state(self, pred, y):
        super().update_state((pred - y).abs())


class RootMeanSquaredError(MeanSquaredError):
    def result(self):
        return math.sqrt(super().result())


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    args = ap.parse_args()
    cfg = dict(DEFAULTS)
    if args.config:
        with open(args.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    return argparse.Namespace(**cfg)


def build_data(cfg, rank, world_size):
    df = pd.read_parquet(cfg.train_path)
    feature_cols = [c for c in df.columns if c not in (cfg.target, "timestamp")]
    # deterministic split: identical on every replica
    perm = np.random.RandomState(cfg.seed).permutation(len(df))
    n_val = int(len(df) * cfg.val_fraction)
    val_df, train_df = df.iloc[perm[:n_val]], df.iloc[perm[n_val:]]
    mean = train_df[feature_cols].to_numpy(np.float32).mean(0)
    std = train_df[feature_cols].to_numpy(np.float32).std(0) + 1e-6
    train_ds = FrameDataset(train_df, feature_cols, cfg.target, mean, std)
    val_ds = FrameDataset(val_df, feature_cols, cfg.target, mean, std)

    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg.seed)
    train_loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=sampler, drop_last=True,
                              num_workers=2, pin_memory=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world_size)), batch_size=4096,
                            num_workers=2, pin_memory=True)
    return train_loader, val_loader, sampler, len(feature_cols), (mean, std)


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(cfg.seed)

    train_loader, val_loader, sampler, n_features, norm = build_data(cfg, rank, world_size)
    model = ResMLP(n_features, cfg.hidden, cfg.blocks, cfg.dropout).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=4, min_lr=1e-5)
    loss_fn = nn.SmoothL1Loss(beta=1.0)

    writer = None
    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        writer = SummaryWriter(cfg.out_dir)
        print(f"features={n_features} replicas={world_size} global_batch={cfg.batch_size * world_size}")

    train_mse, train_mae = MeanSquaredError("mse"), MeanAbsoluteError("mae")
    val_rmse, val_mae = RootMeanSquaredError("val_rmse"), MeanAbsoluteError("val_mae")
    best = math.inf

    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        train_mse.reset_state(); train_mae.reset_state()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            pred = model(x)
            loss = loss_fn(pred, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            train_mse.update_state(pred, y)
            train_mae.update_state(pred, y)

        model.eval()
        val_rmse.reset_state(); val_mae.reset_state()
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                pred = model(x)
                val_rmse.update_state(pred, y)
                val_mae.update_state(pred, y)

        logs = {"mse": train_mse.result(), "mae": train_mae.result(),
                "val_rmse": val_rmse.result(), "val_mae": val_mae.result(), "lr": opt.param_groups[0]["lr"]}
        plateau.step(logs["val_rmse"])

        if rank == 0:
            print(f"epoch {epoch:03d} " + " ".join(f"{k}={v:.5g}" for k, v in logs.items()), flush=True)
            for k, v in logs.items():
                writer.add_scalar(k, v, epoch)
            if logs["val_rmse"] < best:
                best = logs["val_rmse"]
                torch.save({"model": model.module.state_dict(), "mean": norm[0], "std": norm[1],
                            "epoch": epoch, "val_rmse": best}, os.path.join(cfg.out_dir, "best.pt"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
