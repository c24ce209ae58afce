"""Multi-horizon demand forecasting (store x SKU daily sales) with a small Transformer encoder.

Slurm, 2 nodes x 4 GPUs:
    srun --ntasks-per-node=1 torchrun --nnodes=2 --nproc_per_node=4 \
        --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29500 07_timeseries_forecasting.py -c cfg/demand.yaml
"""
import argparse
import logging
import math
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("forecast")


@dataclass
class ForecastConfig:
    data_path: str = "/lustre/forecast/sales_matrix.npz"
    context_len: int = 112
    horizon: int = 28
    d_model: int = 128
    n_heads: int = 8
    n_layers: int = 4
    dropout: float = 0.1
    batch_size: int = 512
    lr: float = 1e-3
    epochs: int = 60
    patience: int = 8
    ckpt_dir: str = "/lustre/forecast/ckpt"
    val_days: int = 56


class WindowDataset(Dataset):
    """Sliding windows over a [num_series, T] matrix; NaN marks days the store was closed / not reporting."""

    def __init__(self, values: np.ndarray, covariates: np.ndarray, context_len: int, horizon: int, stride: int = 7):
        self.values, self.cov = values, covariates
        self.context_len, self.horizon = context_len, horizon
        T = values.shape[1]
        self.index = [(s, t) for s in range(values.shape[0])
                      for t in range(context_len, T - horizon + 1, stride)]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        s, t = self.index[i]
        ctx = self.values[s, t - self.context_len:t]
        tgt = self.values[s, t:t + self.horizon]
        scale = np.nanmean(np.abs(ctx)) + 1.0
        x = np.nan_to_num(ctx / scale)[:, None]
        x = np.concatenate([x, self.cov[t - self.context_len:t]], axis=1).astype(np.float32)
        y_mask = ~np.isnan(tgt)
        y = np.nan_to_num(tgt / scale).astype(np.float32)
        return torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(y_mask), torch.tensor(scale, dtype=torch.float32)


class TransformerForecaster(nn.Module):
    def __init__(self, in_dim, cfg: ForecastConfig):
        super().__init__()
        self.inp = nn.Linear(in_dim, cfg.d_model)
        self.pos = nn.Parameter(torch.randn(1, cfg.context_len, cfg.d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(cfg.d_model, cfg.n_heads, 4 * cfg.d_model, cfg.dropout, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, cfg.n_layers)
        self.head = nn.Linear(cfg.d_model * 2, cfg.horizon)

    def forward(self, x):
        h = self.encoder(self.inp(x) + self.pos)
        return self.head(torch.cat([h[:, -1], h.mean(1)], dim=-1))


def masked_mae(pred, target, mask):
    mask = mask.float()
    return (torch.abs(pred - target) * mask).sum() / mask.sum().clamp(min=1.0)


class CheckpointManager:
    def __init__(self, directory, rank):
        self.directory, self.rank = directory, rank
        os.makedirs(directory, exist_ok=True)

    def save(self, tag, model, optimizer, epoch, best):
        if self.rank != 0:
            return
        tmp = os.path.join(self.directory, f"{tag}.pt.tmp")
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "epoch": epoch, "best": best}, tmp)
        os.replace(tmp, os.path.join(self.directory, f"{tag}.pt"))

    def load(self, tag, model, optimizer, device):
        path = os.path.join(self.directory, f"{tag}.pt")
        if not os.path.exists(path):
            return 0, math.inf
        ckpt = torch.load(path, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        return ckpt["epoch"] + 1, ckpt["best"]


def train_one_epoch(model, loader, optimizer, device):
    model.train()
    acc = torch.zeros(2, device=device)
    for x, y, y_mask, _ in loader:
        x, y, y_mask = x.to(device, non_blocking=True), y.to(device, non_blocking=True), y_mask.to(device)
        if not y_mask.any():
            continue
        loss = masked_mae(model(x), y, y_mask)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        acc += torch.stack([loss.detach(), torch.ones((), device=device)])
    dist.all_reduce(acc)
    return (acc[0] / acc[1].clamp(min=1)).item()


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device)
    for x, y, y_mask, scale in loader:
        x, y, y_mask, scale = x.to(device), y.to(device), y_mask.to(device), scale.to(device)
        pred = model(x)
        err = torch.abs(pred - y) * scale[:, None] * y_mask
        acc += torch.stack([err.sum(), y_mask.sum().float()])
    dist.all_reduce(acc)
    return (acc[0] / acc[1].clamp(min=1)).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-c", "--config", required=True)
    cfg = ForecastConfig(**yaml.safe_load(open(ap.parse_args().config)))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING)

    blob = np.load(cfg.data_path)
    values, cov = blob["sales"].astype(np.float32), blob["calendar"].astype(np.float32)
    split = values.shape[1] - cfg.val_days
    train_ds = WindowDataset(values[:, :split], cov[:split], cfg.context_len, cfg.horizon)
    val_ds = WindowDataset(values[:, split - cfg.context_len:], cov[split - cfg.context_len:],
                           cfg.context_len, cfg.horizon, stride=cfg.horizon)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=train_sampler, num_workers=6,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=cfg.batch_size, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=4)

    model = DDP(TransformerForecaster(1 + cov.shape[1], cfg).to(device), device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=1e-4)
    ckpt = CheckpointManager(cfg.ckpt_dir, rank)
    start_epoch, best = ckpt.load("last", model, optimizer, device)
    bad_epochs = 0

    for epoch in range(start_epoch, cfg.epochs):
        train_sampler.set_epoch(epoch)
        train_loss = train_one_epoch(model, train_loader, optimizer, device)
        val_mae = validate(model, val_loader, device)
        log.info("epoch %d train_mae(scaled) %.4f val_mae %.3f", epoch, train_loss, val_mae)
        if val_mae < best:
            best, bad_epochs = val_mae, 0
            ckpt.save("best", model, optimizer, epoch, best)
        else:
            bad_epochs += 1
        ckpt.save("last", model, optimizer, epoch, best)
        if bad_epochs >= cfg.patience:
            log.info("no improvement for %d epochs, stopping", cfg.patience)
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
