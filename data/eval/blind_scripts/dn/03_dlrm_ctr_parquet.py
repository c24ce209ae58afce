"""CTR model (DLRM-style) for the display-ads ranking stage.

Reads daily impression logs (parquet, one folder per day) produced by the
feature pipeline. All categorical columns are already id-encoded per table.

launch:
    torchrun --standalone --nproc_per_node=8 03_dlrm_ctr_parquet.py --config configs/ctr_dlrm.yaml
"""
import argparse
import dataclasses
import logging
import math
import os
import time
from typing import List

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset

logger = logging.getLogger("ctr")


@dataclasses.dataclass
class Config:
    data_root: str = "/data/ads/impressions"
    train_days: List[str] = dataclasses.field(default_factory=lambda: [f"2024-05-{d:02d}" for d in range(1, 14)])
    val_day: str = "2024-05-14"
    dense_cols: List[str] = dataclasses.field(default_factory=lambda: ["bid", "ctr_7d", "ctr_30d", "age", "hour"])
    sparse_cols: List[str] = dataclasses.field(
        default_factory=lambda: ["advertiser_id", "campaign_id", "creative_id", "site_id", "device_type", "geo_id"]
    )
    table_sizes: List[int] = dataclasses.field(default_factory=lambda: [200_000, 1_000_000, 3_000_000, 150_000, 16, 50_000])
    emb_dim: int = 32
    bottom_mlp: List[int] = dataclasses.field(default_factory=lambda: [256, 64, 32])
    top_mlp: List[int] = dataclasses.field(default_factory=lambda: [512, 256, 1])
    batch_size: int = 8192  # per GPU
    lr_dense: float = 1e-3
    lr_sparse: float = 0.05
    epochs: int = 2
    num_workers: int = 8
    output_dir: str = "/mnt/shared/ads/ctr_dlrm"
    log_interval: int = 200


def load_config(path):
    cfg = Config()
    if path:
        with open(path) as f:
            overrides = yaml.safe_load(f) or {}
        for k, v in overrides.items():
            if not hasattr(cfg, k):
                raise KeyError(f"unknown config key {k}")
            setattr(cfg, k, v)
    return cfg


class ImpressionDataset(Dataset):
    def __init__(self, cfg: Config, days, stats=None):
        frames = [pd.read_parquet(os.path.join(cfg.data_root, f"dt={d}")) for d in days]
        df = pd.concat(frames, ignore_index=True)
        dense = df[cfg.dense_cols].fillna(0.0).to_numpy(np.float32)
        if stats is None:
            stats = (dense.mean(0), dense.std(0) + 1e-6)
        self.stats = stats
        self.dense = (dense - stats[0]) / stats[1]
        self.sparse = df[cfg.sparse_cols].to_numpy(np.int64)
        self.label = df["clicked"].to_numpy(np.float32)

    def __len__(self):
        return len(self.label)

    def __getitem__(self, i):
        return self.dense[i], self.sparse[i], self.label[i]


class DotInteraction(nn.Module):
    def forward(self, x):  # x: (B, F, D)
        z = torch.bmm(x, x.transpose(1, 2))
        f = x.size(1)
        iu = torch.triu_indices(f, f, offset=1, device=x.device)
        return z[:, iu[0], iu[1]]


class DLRM(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.tables = nn.ModuleList([nn.Embedding(n, cfg.emb_dim) for n in cfg.table_sizes])
        for t in self.tables:
            nn.init.normal_(t.weight, std=0.01)
        layers, d = [], len(cfg.dense_cols)
        for h in cfg.bottom_mlp:
            layers += [nn.Linear(d, h), nn.ReLU()]
            d = h
        self.bottom = nn.Sequential(*layers)
        self.interact = DotInteraction()
        nf = len(cfg.sparse_cols) + 1
        d = cfg.emb_dim + nf * (nf - 1) // 2
        layers = []
        for i, h in enumerate(cfg.top_mlp):
            layers.append(nn.Linear(d, h))
            if i < len(cfg.top_mlp) - 1:
                layers.append(nn.ReLU())
            d = h
        self.top = nn.Sequential(*layers)

    def forward(self, dense, sparse):
        x = self.bottom(dense)
        embs = [t(sparse[:, i]) for i, t in enumerate(self.tables)]
        z = self.interact(torch.stack([x] + embs, dim=1))
        return self.top(torch.cat([x, z], dim=1)).squeeze(-1)

    def param_groups(self, cfg):
        sparse = [p for t in self.tables for p in t.parameters()]
        dense = list(self.bottom.parameters()) + list(self.top.parameters())
        return sparse, dense


@torch.no_grad()
def run_eval(model, loader, device):
    model.eval()
    ps, ys = [], []
    for dense, sparse, y in loader:
        p = torch.sigmoid(model(dense.to(device), sparse.to(device)))
        ps.append(p)
        ys.append(y.to(device))
    model.train()
    p, y = torch.cat(ps), torch.cat(ys)
    world = dist.get_world_size()
    # shards differ in length by at most one row; gather as objects
    gathered = [None] * world
    dist.all_gather_object(gathered, (p.cpu().numpy(), y.cpu().numpy()))
    p_all = np.concatenate([g[0] for g in gathered])
    y_all = np.concatenate([g[1] for g in gathered])
    auc = roc_auc_score(y_all, p_all)
    ll = float(F.binary_cross_entropy(torch.from_numpy(p_all).clamp(1e-7, 1 - 1e-7), torch.from_numpy(y_all)))
    return auc, ll


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=None)
    args = parser.parse_args()
    cfg = load_config(args.config)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s r{rank} %(levelname)s %(message)s")
    if rank != 0:
        logger.setLevel(logging.WARNING)

    torch.manual_seed(0)
    train_ds = ImpressionDataset(cfg, cfg.train_days)
    val_ds = ImpressionDataset(cfg, [cfg.val_day], stats=train_ds.stats)
    val_shard = Subset(val_ds, range(rank, len(val_ds), world))

    train_loader = DataLoader(
        train_ds,
        batch_size=cfg.batch_size,
        shuffle=True,
        num_workers=cfg.num_workers,
        pin_memory=True,
        drop_last=True,
        persistent_workers=True,
    )
    val_loader = DataLoader(val_shard, batch_size=cfg.batch_size * 2, num_workers=4, pin_memory=True)

    net = DLRM(cfg).to(device)
    sparse_params, dense_params = net.param_groups(cfg)
    model = DDP(net, device_ids=[local_rank])
    opt_sparse = torch.optim.Adagrad(sparse_params, lr=cfg.lr_sparse)
    opt_dense = torch.optim.AdamW(dense_params, lr=cfg.lr_dense, weight_decay=1e-5)
    steps_per_epoch = len(train_loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt_dense, max_lr=cfg.lr_dense, total_steps=cfg.epochs * steps_per_epoch, pct_start=0.05
    )

    if rank == 0:
        os.makedirs(cfg.output_dir, exist_ok=True)
        logger.info("train=%d val=%d steps/epoch=%d", len(train_ds), len(val_ds), steps_per_epoch)

    for epoch in range(cfg.epochs):
        tic = time.time()
        loss_acc = torch.zeros((), device=device)
        for it, (dense, sparse, y) in enumerate(train_loader):
            dense = dense.to(device, non_blocking=True)
            sparse = sparse.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(dense, sparse), y)
            opt_sparse.zero_grad(set_to_none=True)
            opt_dense.zero_grad(set_to_none=True)
            loss.backward()
            opt_sparse.step()
            opt_dense.step()
            sched.step()
            loss_acc += loss.detach()
            if (it + 1) % cfg.log_interval == 0:
                dist.all_reduce(loss_acc, op=dist.ReduceOp.AVG)
                logger.info(
                    "epoch %d it %d/%d loss %.5f lr %.2e %.1fs",
                    epoch, it + 1, steps_per_epoch, loss_acc.item() / cfg.log_interval,
                    sched.get_last_lr()[0], time.time() - tic,
                )
                loss_acc.zero_()

        auc, ll = run_eval(model.module, val_loader, device)
        logger.info("epoch %d val_auc %.5f val_logloss %.5f", epoch, auc, ll)
        if rank == 0:
            torch.save(
                {"epoch": epoch, "model": model.module.state_dict(), "config": dataclasses.asdict(cfg)},
                os.path.join(cfg.output_dir, f"dlrm_epoch{epoch}.pt"),
            )
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
