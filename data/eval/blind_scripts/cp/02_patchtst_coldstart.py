#!/usr/bin/env python
"""PatchTST channel-independent forecaster, cold-start evaluation.

A global model is trained on a subset of the electricity meters (ECL, 370
clients) and evaluated on meters it never saw during training.

    torchrun --nproc_per_node=8 02_patchtst_coldstart.py --config configs/ecl_cold.yaml
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
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("patchtst")

DEFAULTS = dict(
    csv="/datasets/ecl/electricity.csv",
    out_dir="checkpoints/patchtst_cold",
    lookback=336, horizon=96, patch_len=16, stride=8,
    d_model=128, n_heads=16, n_layers=3, d_ff=256, dropout=0.2,
    batch_size=128, lr=1e-4, epochs=40, warmup_epochs=3, workers=8,
    holdout_frac=0.2, train_frac=0.7, seed=2021,
)


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class WindowDataset(Dataset):
    def __init__(self, values, lookback, horizon, stride=1):
        # values: (T, C) already scaled
        self.v = values.astype(np.float32)
        self.L, self.H = lookback, horizon
        self.n_t = (len(values) - lookback - horizon) // stride + 1
        self.stride = stride
        self.C = values.shape[1]

    def __len__(self):
        return self.n_t * self.C

    def __getitem__(self, idx):
        c, t = divmod(idx, self.n_t)
        t0 = t * self.stride
        x = self.v[t0:t0 + self.L, c]
        y = self.v[t0 + self.L:t0 + self.L + self.H, c]
        return torch.from_numpy(x), torch.from_numpy(y)


class RevIN(nn.Module):
    def __init__(self, eps=1e-5):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        mean = x.mean(dim=1, keepdim=True).detach()
        std = torch.sqrt(x.var(dim=1, keepdim=True, unbiased=False) + self.eps).detach()
        return (x - mean) / std, mean, std


class PatchTST(nn.Module):
    def __init__(self, lookback, horizon, patch_len, stride, d_model, n_heads, n_layers, d_ff, dropout):
        super().__init__()
        self.patch_len, self.stride = patch_len, stride
        n_patches = (lookback - patch_len) // stride + 2  # +1 from end padding
        self.revin = RevIN()
        self.pad = nn.ReplicationPad1d((0, stride))
        self.embed = nn.Linear(patch_len, d_model)
        self.pos = nn.Parameter(torch.randn(1, n_patches, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, d_ff, dropout, batch_first=True,
                                           norm_first=True, activation="gelu")
        self.encoder = nn.TransformerEncoder(layer, n_layers)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Sequential(nn.Flatten(1), nn.Dropout(dropout),
                                  nn.Linear(n_patches * d_model, horizon))

    def forward(self, x):  # x: (B, L)
        x, mean, std = self.revin(x.unsqueeze(-1))
        x = self.pad(x.transpose(1, 2)).squeeze(1)
        patches = x.unfold(-1, self.patch_len, self.stride)  # (B, N, P)
        z = self.drop(self.embed(patches) + self.pos)
        z = self.encoder(z)
        out = self.head(z)
        return out * std.squeeze(-1) + mean.squeeze(-1)


def load_config():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default=None)
    p.add_argument("--resume", action="store_true")
    a = p.parse_args()
    cfg = dict(DEFAULTS)
    if a.config:
        with open(a.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    cfg["resume"] = a.resume
    return argparse.Namespace(**cfg)


def build_splits(cfg):
    df = pd.read_csv(cfg.csv, index_col=0, parse_dates=True)
    values = df.to_numpy(np.float32)
    n_series = values.shape[1]
    perm = np.random.permutation(n_series)
    n_hold = int(round(cfg.holdout_frac * n_series))
    hold_cols, train_cols = np.sort(perm[:n_hold]), np.sort(perm[n_hold:])

    T = len(values)
    t_train = int(cfg.train_frac * T)
    seen = values[:, train_cols]
    mu = seen[:t_train].mean(0, keepdims=True)
    sd = seen[:t_train].std(0, keepdims=True) + 1e-6
    train = (seen[:t_train] - mu) / sd
    val = (seen[t_train - cfg.lookback:] - mu) / sd
    # unseen meters: scale with their own history before the test origin
    unseen = values[:, hold_cols]
    mu_u = unseen[:t_train].mean(0, keepdims=True)
    sd_u = unseen[:t_train].std(0, keepdims=True) + 1e-6
    test = (unseen[t_train - cfg.lookback:] - mu_u) / sd_u
    return train, val, test


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(x)
        pred = pred.float()
        acc[0] += ((pred - y) ** 2).sum()
        acc[1] += (pred - y).abs().sum()
        acc[2] += y.numel()
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    cfg = load_config()
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")
    # offset per rank so dropout masks / worker shuffles are not identical across GPUs
    seed_everything(cfg.seed + rank)

    train, val, test = build_splits(cfg)
    train_ds = WindowDataset(train, cfg.lookback, cfg.horizon)
    val_ds = WindowDataset(val, cfg.lookback, cfg.horizon, stride=cfg.horizon)
    test_ds = WindowDataset(test, cfg.lookback, cfg.horizon, stride=cfg.horizon)
    log.info("windows: train %d val %d test %d", len(train_ds), len(val_ds), len(test_ds))

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=train_sampler,
                              num_workers=cfg.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    # strided shards (no padding) so each eval window is scored once
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)),
                            batch_size=512, num_workers=4)
    test_loader = DataLoader(Subset(test_ds, range(rank, len(test_ds), world)),
                             batch_size=512, num_workers=4)

    model = PatchTST(cfg.lookback, cfg.horizon, cfg.patch_len, cfg.stride, cfg.d_model,
                     cfg.n_heads, cfg.n_layers, cfg.d_ff, cfg.dropout).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    optim = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    total = cfg.epochs * len(train_loader)
    warm = cfg.warmup_epochs * len(train_loader)
    lr_lambda = lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total))
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_lambda)
    os.makedirs(cfg.out_dir, exist_ok=True)
    ckpt_path = os.path.join(cfg.out_dir, "last.pt")
    start, best = 0, float("inf")
    if cfg.resume and os.path.exists(ckpt_path):
        state = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        sched.load_state_dict(state["sched"])
        start, best = state["epoch"] + 1, state["best"]

    for epoch in range(start, cfg.epochs):
        train_sampler.set_epoch(epoch)
        running, n = 0.0, 0
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(x)
            loss = nn.functional.mse_loss(pred.float(), y)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            sched.step()
            running += loss.item()
            n += 1
        val_mse, val_mae = evaluate(model, val_loader, device)
        log.info("epoch %d | train mse %.4f | val mse %.4f mae %.4f | lr %.2e",
                 epoch, running / max(n, 1), val_mse, val_mae, sched.get_last_lr()[0])
        if rank == 0:
            state = {"model": model.module.state_dict(), "optim": optim.state_dict(),
                     "sched": sched.state_dict(), "epoch": epoch, "best": min(best, val_mse)}
            torch.save(state, ckpt_path)
            if val_mse < best:
                torch.save(state, os.path.join(cfg.out_dir, "best.pt"))
        best = min(best, val_mse)
        dist.barrier()

    state = torch.load(os.path.join(cfg.out_dir, "best.pt"), map_location=device)
    model.module.load_state_dict(state["model"])
    test_mse, test_mae = evaluate(model, test_loader, device)
    log.info("cold-start test | mse %.4f | mae %.4f", test_mse, test_mae)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
