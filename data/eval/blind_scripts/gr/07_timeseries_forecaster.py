"""
Multivariate load forecasting with a small Transformer encoder.

DDP port of forecast_train.py. Training is long (preemptible queue), so it
checkpoints every epoch and can resume with --resume.

    torchrun --nproc_per_node=4 07_timeseries_forecaster.py \
        --csv data/electricity.csv --resume checkpoints/forecast/last.pt
"""
import argparse
import logging
import math
import os
import random

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--csv", required=True)
    parser.add_argument("--context", type=int, default=336)
    parser.add_argument("--horizon", type=int, default=96)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--n-heads", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--val-frac", type=float, default=0.2)
    parser.add_argument("--ckpt-dir", default="checkpoints/forecast")
    parser.add_argument("--resume", default=None)
    parser.add_argument("--seed", type=int, default=2024)
    return parser.parse_args()


def setup_ddp():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return local_rank


def cleanup_ddp():
    if dist.is_initialized():
        dist.destroy_process_group()


def is_main_process():
    return dist.get_rank() == 0


def get_logger(name="forecast"):
    logger = logging.getLogger(name)
    if is_main_process():
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    else:
        logger.setLevel(logging.WARNING)
    return logger


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class WindowDataset(Dataset):
    """Sliding windows over a (T, C) array. Time split, so no leakage between train/val."""

    def __init__(self, values, context, horizon):
        self.values = torch.from_numpy(values).float()
        self.context = context
        self.horizon = horizon

    def __len__(self):
        return len(self.values) - self.context - self.horizon + 1

    def __getitem__(self, i):
        x = self.values[i:i + self.context]
        y = self.values[i + self.context:i + self.context + self.horizon]
        return x, y


class Forecaster(nn.Module):
    def __init__(self, n_channels, context, horizon, d_model, n_layers, n_heads):
        super().__init__()
        self.input_proj = nn.Linear(n_channels, d_model)
        self.pos = nn.Parameter(torch.zeros(1, context, d_model))
        layer = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout=0.1,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layers)
        self.head = nn.Linear(context * d_model, horizon * n_channels)
        self.horizon, self.n_channels = horizon, n_channels
        nn.init.trunc_normal_(self.pos, std=0.02)

    def forward(self, x):
        h = self.encoder(self.input_proj(x) + self.pos)
        out = self.head(h.flatten(1))
        return out.view(-1, self.horizon, self.n_channels)


def load_series(csv_path, val_frac):
    df = pd.read_csv(csv_path, index_col=0, parse_dates=True)
    values = df.values.astype(np.float32)
    n_train = int(len(values) * (1 - val_frac))
    mean = values[:n_train].mean(0)
    std = values[:n_train].std(0) + 1e-6
    values = (values - mean) / std
    return values[:n_train], values[n_train:], mean, std


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    sums = torch.zeros(3, device=device)  # squared error, absolute error, n elements
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        pred = model(x)
        sums[0] += ((pred - y) ** 2).sum()
        sums[1] += (pred - y).abs().sum()
        sums[2] += y.numel()
    dist.all_reduce(sums)
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()


def main():
    args = parse_args()
    local_rank = setup_ddp()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logger = get_logger()
    seed_everything(args.seed)

    train_vals, val_vals, mean, std = load_series(args.csv, args.val_frac)
    n_channels = train_vals.shape[1]
    train_ds = WindowDataset(train_vals, args.context, args.horizon)
    val_ds = WindowDataset(val_vals, args.context, args.horizon)

    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_shard = Subset(val_ds, range(rank, len(val_ds), world_size))
    val_loader = DataLoader(val_shard, batch_size=256, shuffle=False, num_workers=2)

    model = Forecaster(n_channels, args.context, args.horizon, args.d_model,
                       args.n_layers, args.n_heads).to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr * math.sqrt(world_size),
                                  weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr * math.sqrt(world_size),
                                                    total_steps=args.epochs * len(train_loader),
                                                    pct_start=0.1)
    criterion = nn.MSELoss()

    start_epoch = 0
    best_mse = float("inf")
    if args.resume and os.path.isfile(args.resume):
        checkpoint = torch.load(args.resume)
        model.module.load_state_dict(checkpoint["model_state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer_state_dict"])
        scheduler.load_state_dict(checkpoint["scheduler_state_dict"])
        start_epoch = checkpoint["epoch"] + 1
        best_mse = checkpoint["best_mse"]
        logger.info(f"Resumed from {args.resume} (epoch {start_epoch})")

    writer = SummaryWriter(log_dir=os.path.join(args.ckpt_dir, "tb")) if is_main_process() else None
    if is_main_process():
        os.makedirs(args.ckpt_dir, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        epoch_loss = torch.zeros(1, device=device)
        for x, y in tqdm(train_loader, disable=not is_main_process(), desc=f"epoch {epoch}"):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = criterion(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            epoch_loss += loss.detach()

        dist.all_reduce(epoch_loss)
        train_mse = epoch_loss.item() / (len(train_loader) * world_size)
        val_mse, val_mae = evaluate(model, val_loader, device)

        if is_main_process():
            logger.info(f"epoch {epoch}: train_mse={train_mse:.4f} val_mse={val_mse:.4f} val_mae={val_mae:.4f}")
            writer.add_scalar("loss/train", train_mse, epoch)
            writer.add_scalar("loss/val_mse", val_mse, epoch)
            writer.add_scalar("loss/val_mae", val_mae, epoch)
            best_mse = min(best_mse, val_mse)
            checkpoint = {
                "epoch": epoch,
                "model_state_dict": model.module.state_dict(),
                "optimizer_state_dict": optimizer.state_dict(),
                "scheduler_state_dict": scheduler.state_dict(),
                "best_mse": best_mse,
                "norm": {"mean": mean.tolist(), "std": std.tolist()},
            }
            torch.save(checkpoint, os.path.join(args.ckpt_dir, "last.pt"))
            if val_mse == best_mse:
                torch.save(checkpoint, os.path.join(args.ckpt_dir, "best.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    cleanup_ddp()


if __name__ == "__main__":
    main()
