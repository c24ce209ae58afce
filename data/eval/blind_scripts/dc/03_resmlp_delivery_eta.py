"""ResNet-style MLP baseline for delivery-time regression (minutes), CSV input.

torchrun --standalone --nproc_per_node=4 03_resmlp_delivery_eta.py --config configs/eta_mlp.yaml
"""
import argparse
import logging
import os
import pickle
import time
from dataclasses import dataclass, field
from typing import List

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from sklearn.preprocessing import StandardScaler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

log = logging.getLogger(__name__)


@dataclass
class Config:
    train_csv: str = "/data/eta/train.csv"
    val_csv: str = "/data/eta/val.csv"
    target: str = "eta_minutes"
    cat_cols: List[str] = field(default_factory=lambda: ["store_id", "market_id", "vehicle_type", "hour", "dow"])
    emb_dim: int = 16
    hidden: int = 512
    n_blocks: int = 4
    dropout: float = 0.1
    global_batch: int = 4096
    lr: float = 2e-3
    epochs: int = 25
    warmup_epochs: int = 1
    seed: int = 17
    out_dir: str = "runs/eta_mlp"


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--out-dir", default=None)
    a = ap.parse_args()
    cfg = Config()
    if a.config:
        with open(a.config) as f:
            for k, v in yaml.safe_load(f).items():
                setattr(cfg, k, v)
    if a.out_dir:
        cfg.out_dir = a.out_dir
    return cfg


class ResBlock(nn.Module):
    def __init__(self, d, dropout):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Dropout(dropout), nn.Linear(2 * d, d), nn.Dropout(dropout))

    def forward(self, x):
        return x + self.ff(self.norm(x))


class ResMLP(nn.Module):
    def __init__(self, n_num, cards, emb_dim, hidden, n_blocks, dropout):
        super().__init__()
        self.embs = nn.ModuleList(nn.Embedding(c, emb_dim) for c in cards)
        self.inp = nn.Linear(n_num + emb_dim * len(cards), hidden)
        self.blocks = nn.Sequential(*[ResBlock(hidden, dropout) for _ in range(n_blocks)])
        self.head = nn.Sequential(nn.LayerNorm(hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x_num, x_cat):
        e = [emb(x_cat[:, i]) for i, emb in enumerate(self.embs)]
        h = self.inp(torch.cat([x_num] + e, dim=1))
        return self.head(self.blocks(h)).squeeze(-1)


def build_features(cfg):
    tr = pd.read_csv(cfg.train_csv)
    va = pd.read_csv(cfg.val_csv)
    num_cols = [c for c in tr.columns if c not in cfg.cat_cols + [cfg.target]]

    cards = []
    for c in cfg.cat_cols:
        cats = pd.Index(sorted(tr[c].astype(str).unique()))
        cards.append(len(cats) + 1)
        for df in (tr, va):
            codes = cats.get_indexer(df[c].astype(str))
            df[c] = codes + 1  # -1 (unseen) -> 0

    fill = tr[num_cols].median()
    scaler = StandardScaler().fit(tr[num_cols].fillna(fill).values)
    y_mu, y_sd = tr[cfg.target].mean(), tr[cfg.target].std()

    def to_ds(df):
        xn = scaler.transform(df[num_cols].fillna(fill).values).astype(np.float32)
        xc = df[cfg.cat_cols].values.astype(np.int64)
        y = ((df[cfg.target].values - y_mu) / y_sd).astype(np.float32)
        return TensorDataset(torch.from_numpy(xn), torch.from_numpy(xc), torch.from_numpy(y))

    meta = {"num_cols": num_cols, "cards": cards, "fill": fill, "scaler": scaler, "y_mu": y_mu, "y_sd": y_sd}
    return to_ds(tr), to_ds(va), meta


@torch.no_grad()
def validate(model, val_ds, rank, world, device, y_sd):
    model.eval()
    xn, xc, y = val_ds.tensors
    sl = slice(rank, None, world)
    xn, xc, y = xn[sl], xc[sl], y[sl]
    sse, sae = 0.0, 0.0
    for i in range(0, len(y), 8192):
        p = model(xn[i:i + 8192].to(device), xc[i:i + 8192].to(device)).float().cpu()
        d = (p - y[i:i + 8192]) * y_sd
        sse += float((d ** 2).sum())
        sae += float(d.abs().sum())
    stats = torch.tensor([sse, sae, float(len(y))], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    sse, sae, n = stats.tolist()
    return (sse / n) ** 0.5, sae / n


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format=f"[rank{rank}] %(asctime)s %(message)s")
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)

    train_ds, val_ds, meta = build_features(cfg)
    model = ResMLP(len(meta["num_cols"]), meta["cards"], cfg.emb_dim, cfg.hidden, cfg.n_blocks, cfg.dropout).to(device)
    model = DDP(model, device_ids=[local_rank])

    assert cfg.global_batch % world == 0
    sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=cfg.global_batch // world, sampler=sampler,
                        num_workers=4, pin_memory=True, drop_last=True)

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=1e-4)
    total = cfg.epochs * len(loader)
    warm = cfg.warmup_epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + np.cos(np.pi * min(1.0, s / total))))
    loss_fn = nn.HuberLoss(delta=1.0)

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(os.path.join(cfg.out_dir, "preprocess.pkl"), "wb") as f:
            pickle.dump(meta, f)

    best_rmse = float("inf")
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (xn, xc, y) in enumerate(loader):
            xn, xc, y = xn.to(device, non_blocking=True), xc.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = loss_fn(model(xn, xc), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and step % 200 == 0:
                log.info("epoch %d step %d/%d loss %.4f lr %.2e", epoch, step, len(loader), loss.item(),
                         sched.get_last_lr()[0])

        rmse, mae = validate(model.module, val_ds, rank, world, device, meta["y_sd"])
        log.info("epoch %d val rmse %.3f min, mae %.3f min, %.0fs", epoch, rmse, mae, time.time() - t0)
        if rank == 0 and rmse < best_rmse:
            best_rmse = rmse
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "rmse": rmse},
                       os.path.join(cfg.out_dir, "best.pt"))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
