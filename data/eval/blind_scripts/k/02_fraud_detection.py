"""Card-transaction fraud classifier (categorical embeddings + MLP) trained with DDP.

    torchrun --nnodes=1 --nproc_per_node=4 02_fraud_detection.py --config configs/fraud.yaml
"""
import argparse
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger(__name__)

CATEGORICAL = ["merchant_id", "mcc", "country", "channel", "card_type", "device_os"]
NUMERIC = ["amount_log", "hour_sin", "hour_cos", "txn_count_1h", "txn_count_24h",
           "amount_zscore_30d", "days_since_last", "distance_home_km"]


@dataclass
class Config:
    train_parquet: str = "s3-cache/fraud/train.parquet"
    valid_parquet: str = "s3-cache/fraud/valid.parquet"
    vocab_sizes: Dict[str, int] = field(default_factory=lambda: {
        "merchant_id": 200_000, "mcc": 1000, "country": 250, "channel": 8, "card_type": 16, "device_os": 32})
    emb_dim: int = 16
    hidden: List[int] = field(default_factory=lambda: [256, 128])
    pos_weight: float = 40.0
    batch_size: int = 4096
    lr: float = 1e-3
    epochs: int = 10
    threshold: float = 0.5
    out_dir: str = "checkpoints/fraud"


class TxnDataset(Dataset):
    def __init__(self, parquet_path: str, vocab_sizes: Dict[str, int]):
        df = pd.read_parquet(parquet_path)
        cats = np.stack([df[c].to_numpy().astype(np.int64) % vocab_sizes[c] for c in CATEGORICAL], axis=1)
        self.cats = torch.from_numpy(cats)
        self.nums = torch.from_numpy(df[NUMERIC].fillna(0.0).to_numpy(np.float32))
        self.y = torch.from_numpy(df["is_fraud"].to_numpy(np.float32))

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.cats[i], self.nums[i], self.y[i]


class FraudNet(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.embs = nn.ModuleList([nn.Embedding(cfg.vocab_sizes[c], cfg.emb_dim) for c in CATEGORICAL])
        d = cfg.emb_dim * len(CATEGORICAL) + len(NUMERIC)
        layers = []
        for h in cfg.hidden:
            layers += [nn.Linear(d, h), nn.BatchNorm1d(h), nn.ReLU(), nn.Dropout(0.2)]
            d = h
        self.mlp = nn.Sequential(*layers)
        self.head = nn.Linear(d, 1)

    def forward(self, cats, nums):
        x = torch.cat([emb(cats[:, i]) for i, emb in enumerate(self.embs)] + [nums], dim=1)
        return self.head(self.mlp(x)).squeeze(-1)


class MetricTracker:
    """Accumulates confusion counts across the epoch and reduces them over ranks."""

    def __init__(self, threshold: float):
        self.threshold = threshold
        self.reset()

    def reset(self):
        self.probs: List[np.ndarray] = []
        self.labels: List[np.ndarray] = []
        self.loss_sum, self.n = 0.0, 0

    def update(self, logits, y, loss):
        self.probs.append(torch.sigmoid(logits).float().cpu().numpy())
        self.labels.append(y.cpu().numpy())
        self.loss_sum += loss.item() * y.numel()
        self.n += y.numel()

    def compute(self):
        p = np.concatenate(self.probs)
        y = np.concatenate(self.labels).astype(bool)
        pred = p >= self.threshold
        tp = float(np.sum(pred & y))
        fp = float(np.sum(pred & ~y))
        fn = float(np.sum(~pred & y))
        stats = torch.tensor([tp, fp, fn, self.loss_sum, float(self.n)], dtype=torch.float64)
        dist.all_reduce(stats, op=dist.ReduceOp.SUM)
        tp, fp, fn, loss_sum, n = stats.tolist()
        precision = tp / max(tp + fp, 1.0)
        recall = tp / max(tp + fn, 1.0)
        f1 = 2 * precision * recall / max(precision + recall, 1e-8)
        return {"loss": loss_sum / max(n, 1.0), "precision": precision, "recall": recall, "f1": f1}


def setup():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    return local_rank, dist.get_rank(), dist.get_world_size()


def run_epoch(model, loader, criterion, device, tracker, optimizer=None):
    training = optimizer is not None
    model.train(training)
    tracker.reset()
    with torch.set_grad_enabled(training):
        for cats, nums, y in loader:
            cats, nums, y = cats.to(device, non_blocking=True), nums.to(device, non_blocking=True), y.to(device)
            logits = model(cats, nums)
            loss = criterion(logits, y)
            if training:
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            tracker.update(logits.detach(), y, loss.detach())
    return tracker.compute()


def main(cfg: Config):
    local_rank, rank, world_size = setup()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR)

    train_ds = TxnDataset(cfg.train_parquet, cfg.vocab_sizes)
    valid_ds = TxnDataset(cfg.valid_parquet, cfg.vocab_sizes)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    valid_sampler = DistributedSampler(valid_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, persistent_workers=True)
    valid_loader = DataLoader(valid_ds, batch_size=cfg.batch_size, sampler=valid_sampler,
                              num_workers=4, pin_memory=True)

    model = FraudNet(cfg).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    criterion = nn.BCEWithLogitsLoss(pos_weight=torch.tensor(cfg.pos_weight, device=device))
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.epochs)

    best_f1 = -1.0
    out = Path(cfg.out_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)

    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        train_metrics = run_epoch(model, train_loader, criterion, device, MetricTracker(cfg.threshold), optimizer)
        valid_metrics = run_epoch(model, valid_loader, criterion, device, MetricTracker(cfg.threshold))
        scheduler.step()
        if rank == 0:
            log.info("epoch %d train %s valid %s", epoch, train_metrics, valid_metrics)
            if valid_metrics["f1"] > best_f1:
                best_f1 = valid_metrics["f1"]
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "f1": best_f1},
                           out / "best.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", type=str, default=None)
    a = ap.parse_args()
    conf = Config()
    if a.config:
        with open(a.config) as fh:
            conf = Config(**yaml.safe_load(fh))
    main(conf)
