"""Store-level demand forecasting: entity-embedding MLP on tabular features.

Launch:
    torchrun --standalone --nproc_per_node=4 03_demand_forecast_mlp.py --config configs/demand.yaml
"""
import argparse
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import List

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torch.utils.tensorboard import SummaryWriter

log = logging.getLogger("demand")


@dataclass
class Config:
    train_path: str = "data/demand/train.parquet"
    val_path: str = "data/demand/val.parquet"
    cat_cols: List[str] = field(default_factory=lambda: ["store_id", "item_id", "dow", "month", "promo"])
    num_cols: List[str] = field(default_factory=lambda: ["price", "lag_7", "lag_28", "rmean_7", "rmean_28"])
    target: str = "units"
    emb_dim: int = 16
    hidden: List[int] = field(default_factory=lambda: [512, 256, 128])
    dropout: float = 0.1
    batch_size: int = 2048
    lr: float = 2e-3
    weight_decay: float = 1e-5
    epochs: int = 40
    clip_grad: float = 5.0
    patience: int = 5
    out_dir: str = "runs/demand_mlp"
    num_workers: int = 2


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    args = ap.parse_args()
    cfg = Config()
    if args.config:
        for k, v in yaml.safe_load(Path(args.config).read_text()).items():
            setattr(cfg, k, v)
    return cfg


# ------------------------------------------------------------------ model
class DemandMLP(nn.Module):
    def __init__(self, cardinalities, n_num, emb_dim, hidden, dropout):
        super().__init__()
        self.embs = nn.ModuleList(nn.Embedding(c, min(emb_dim, (c + 1) // 2)) for c in cardinalities)
        in_dim = sum(e.embedding_dim for e in self.embs) + n_num
        layers = []
        for h in hidden:
            layers += [nn.Linear(in_dim, h), nn.LayerNorm(h), nn.SiLU(), nn.Dropout(dropout)]
            in_dim = h
        self.mlp = nn.Sequential(*layers)
        self.head = nn.Linear(in_dim, 1)

    def forward(self, x_cat, x_num):
        z = torch.cat([e(x_cat[:, i]) for i, e in enumerate(self.embs)] + [x_num], dim=1)
        return self.head(self.mlp(z)).squeeze(1)


def tweedie_loss(pred_log, y, p=1.5):
    mu = torch.exp(pred_log)
    return (-y * mu.pow(1 - p) / (1 - p) + mu.pow(2 - p) / (2 - p)).mean()


# ------------------------------------------------------------------ callbacks
class Callback:
    def on_epoch_end(self, trainer, logs):
        pass


class EarlyStopping(Callback):
    def __init__(self, monitor, patience):
        self.monitor, self.patience = monitor, patience
        self.best, self.count = math.inf, 0

    def on_epoch_end(self, trainer, logs):
        if logs[self.monitor] < self.best - 1e-6:
            self.best, self.count = logs[self.monitor], 0
        else:
            self.count += 1
            if self.count >= self.patience:
                log.info("early stopping at epoch %d", trainer.epoch)
                trainer.should_stop = True


class ModelCheckpoint(Callback):
    def __init__(self, out_dir, monitor):
        self.out_dir, self.monitor, self.best = Path(out_dir), monitor, math.inf

    def on_epoch_end(self, trainer, logs):
        if trainer.rank == 0 and logs[self.monitor] < self.best:
            self.best = logs[self.monitor]
            self.out_dir.mkdir(parents=True, exist_ok=True)
            torch.save({"model": trainer.module.state_dict(), "epoch": trainer.epoch, "logs": logs},
                       self.out_dir / "best.pt")


class TensorBoardLogger(Callback):
    def __init__(self, out_dir, rank):
        self.writer = SummaryWriter(os.path.join(out_dir, "tb")) if rank == 0 else None

    def on_epoch_end(self, trainer, logs):
        if self.writer is None:
            return
        for k, v in logs.items():
            self.writer.add_scalar(k, v, trainer.epoch)
        self.writer.add_scalar("lr", trainer.optimizer.param_groups[0]["lr"], trainer.epoch)
        self.writer.flush()


# ------------------------------------------------------------------ trainer
class Trainer:
    def __init__(self, model, optimizer, scheduler, device, rank, world_size, callbacks, clip_grad=None):
        self.device, self.rank, self.world_size = device, rank, world_size
        self.module = model.to(device)
        self.model = DDP(self.module, device_ids=[device.index]) if world_size > 1 else self.module
        self.optimizer, self.scheduler = optimizer, scheduler
        self.callbacks = callbacks
        self.clip_grad = clip_grad
        self.epoch = 0
        self.should_stop = False

    def _all_reduce(self, *vals):
        t = torch.tensor(vals, device=self.device, dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(t)
        return t.tolist()

    def run_epoch(self, loader):
        self.model.train()
        tot, n = 0.0, 0
        for x_cat, x_num, y in loader:
            x_cat, x_num, y = x_cat.to(self.device), x_num.to(self.device), y.to(self.device)
            loss = tweedie_loss(self.model(x_cat, x_num), y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if self.clip_grad:
                nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad)
            self.optimizer.step()
            self.scheduler.step()
            tot += loss.item() * y.numel()
            n += y.numel()
        tot, n = self._all_reduce(tot, n)
        return tot / n

    @torch.no_grad()
    def evaluate(self, loader):
        self.module.eval()
        se, ae, tw, n = 0.0, 0.0, 0.0, 0
        for x_cat, x_num, y in loader:
            x_cat, x_num, y = x_cat.to(self.device), x_num.to(self.device), y.to(self.device)
            pred_log = self.module(x_cat, x_num)
            pred = torch.exp(pred_log)
            se += ((pred - y) ** 2).sum().item()
            ae += (pred - y).abs().sum().item()
            tw += tweedie_loss(pred_log, y).item() * y.numel()
            n += y.numel()
        se, ae, tw, n = self._all_reduce(se, ae, tw, n)
        return {"val_rmse": math.sqrt(se / n), "val_mae": ae / n, "val_tweedie": tw / n}

    def fit(self, train_loader, val_loader, epochs):
        for epoch in range(epochs):
            self.epoch = epoch
            logs = {"train_tweedie": self.run_epoch(train_loader)}
            logs.update(self.evaluate(val_loader))
            if self.rank == 0:
                log.info("epoch %03d  %s", epoch, "  ".join(f"{k}={v:.4f}" for k, v in logs.items()))
            for cb in self.callbacks:
                cb.on_epoch_end(self, logs)
            if self.should_stop:
                break


# ------------------------------------------------------------------ data
def encode(df, cfg, vocab, mean, std):
    cats = np.stack([df[c].map(vocab[c]).fillna(0).astype(np.int64).values for c in cfg.cat_cols], 1)
    nums = ((df[cfg.num_cols].values - mean) / std).astype(np.float32)
    return TensorDataset(torch.from_numpy(cats), torch.from_numpy(nums),
                         torch.from_numpy(df[cfg.target].values.astype(np.float32)))


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING)
    torch.manual_seed(0)

    train_df = pd.read_parquet(cfg.train_path)
    val_df = pd.read_parquet(cfg.val_path)
    # vocab / scaling come from the training file only; deterministic on every rank (sorted)
    vocab = {c: {v: i + 1 for i, v in enumerate(sorted(train_df[c].unique()))} for c in cfg.cat_cols}
    mean = train_df[cfg.num_cols].values.mean(0)
    std = train_df[cfg.num_cols].values.std(0) + 1e-6
    train_ds = encode(train_df, cfg, vocab, mean, std)
    val_ds = encode(val_df, cfg, vocab, mean, std)

    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=train_sampler,
                              num_workers=cfg.num_workers, pin_memory=True)
    val_idx = list(range(rank, len(val_ds), world_size))
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, val_idx), batch_size=cfg.batch_size * 4,
                            num_workers=cfg.num_workers)

    model = DemandMLP([len(vocab[c]) + 1 for c in cfg.cat_cols], len(cfg.num_cols),
                      cfg.emb_dim, cfg.hidden, cfg.dropout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=cfg.lr, epochs=cfg.epochs,
                                                    steps_per_epoch=len(train_loader))
    callbacks = [TensorBoardLogger(cfg.out_dir, rank),
                 ModelCheckpoint(cfg.out_dir, "val_tweedie"),
                 EarlyStopping("val_tweedie", cfg.patience)]
    trainer = Trainer(model, optimizer, scheduler, device, rank, world_size, callbacks, cfg.clip_grad)
    trainer.fit(train_loader, val_loader, cfg.epochs)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
