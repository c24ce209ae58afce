#!/usr/bin/env python
"""Listwise learning-to-rank trainer (ListNet) for search result reranking.

Launch:
    torchrun --nproc_per_node=8 01_ranking_listwise.py --config configs/ranker_base.yaml
"""
import argparse
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("ranker")


@dataclass
class RankerConfig:
    train_path: str = "data/mslr/train.npz"
    valid_path: str = "data/mslr/vali.npz"
    output_dir: str = "runs/ranker"
    num_features: int = 136
    hidden_dims: List[int] = field(default_factory=lambda: [512, 256, 128])
    dropout: float = 0.1
    list_size: int = 64
    batch_size: int = 32
    lr: float = 3e-4
    weight_decay: float = 1e-5
    epochs: int = 30
    patience: int = 5
    keep_last: int = 3
    num_workers: int = 4
    seed: int = 17

    @classmethod
    def from_yaml(cls, path: Optional[str]) -> "RankerConfig":
        if path is None:
            return cls()
        with open(path) as f:
            return cls(**yaml.safe_load(f))


class QueryListDataset(Dataset):
    """One item per query: features [list_size, F], graded relevance [list_size], validity mask."""

    def __init__(self, path: str, list_size: int):
        blob = np.load(path)
        self.features = blob["features"].astype(np.float32)
        self.labels = blob["labels"].astype(np.float32)
        self.offsets = blob["qid_offsets"]
        self.list_size = list_size

    def __len__(self):
        return len(self.offsets) - 1

    def __getitem__(self, idx):
        start, end = int(self.offsets[idx]), int(self.offsets[idx + 1])
        n = min(end - start, self.list_size)
        feats = np.zeros((self.list_size, self.features.shape[1]), dtype=np.float32)
        labels = np.zeros(self.list_size, dtype=np.float32)
        mask = np.zeros(self.list_size, dtype=np.bool_)
        feats[:n] = self.features[start:start + n]
        labels[:n] = self.labels[start:start + n]
        mask[:n] = True
        return torch.from_numpy(feats), torch.from_numpy(labels), torch.from_numpy(mask)


class MLPScorer(nn.Module):
    def __init__(self, num_features: int, hidden_dims: List[int], dropout: float):
        super().__init__()
        layers, d = [nn.LayerNorm(num_features)], num_features
        for h in hidden_dims:
            layers += [nn.Linear(d, h), nn.GELU(), nn.Dropout(dropout)]
            d = h
        layers.append(nn.Linear(d, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x).squeeze(-1)


def listnet_loss(scores, labels, mask):
    scores = scores.masked_fill(~mask, -1e4)
    target = labels.masked_fill(~mask, -1e4)
    return -(F.softmax(target, dim=-1) * F.log_softmax(scores, dim=-1)).sum(-1).mean()


def ndcg_at_k(scores, labels, mask, k=10):
    scores = scores.masked_fill(~mask, -1e9)
    _, order = scores.sort(dim=-1, descending=True)
    gains = (2 ** labels.gather(1, order) - 1)[:, :k]
    discounts = 1.0 / torch.log2(torch.arange(2, k + 2, device=scores.device).float())
    dcg = (gains * discounts).sum(-1)
    ideal = (2 ** labels.masked_fill(~mask, 0).sort(dim=-1, descending=True).values - 1)[:, :k]
    idcg = (ideal * discounts).sum(-1)
    valid = idcg > 0
    return (dcg[valid] / idcg[valid]).sum(), valid.sum()


class CheckpointManager:
    def __init__(self, output_dir: str, keep_last: int, is_main: bool):
        self.dir = Path(output_dir)
        self.keep_last = keep_last
        self.is_main = is_main
        if is_main:
            self.dir.mkdir(parents=True, exist_ok=True)

    def save(self, epoch, model, optimizer, metric):
        if not self.is_main:
            return
        path = self.dir / f"epoch_{epoch:03d}.pt"
        torch.save({"epoch": epoch, "model": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(), "metric": metric}, path)
        ckpts = sorted(self.dir.glob("epoch_*.pt"))
        for old in ckpts[:-self.keep_last]:
            old.unlink()

    def latest(self):
        ckpts = sorted(self.dir.glob("epoch_*.pt"))
        return ckpts[-1] if ckpts else None


class EarlyStopping:
    def __init__(self, patience: int):
        self.patience, self.best, self.bad = patience, -float("inf"), 0

    def on_epoch_end(self, trainer, epoch, metrics):
        if metrics["ndcg@10"] > self.best:
            self.best, self.bad = metrics["ndcg@10"], 0
        else:
            self.bad += 1
        if self.bad >= self.patience:
            trainer.should_stop = True


class Trainer:
    def __init__(self, cfg: RankerConfig, callbacks=None):
        self.cfg = cfg
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        self.is_main = self.rank == 0
        self.callbacks = callbacks or []
        self.should_stop = False

        train_ds = QueryListDataset(cfg.train_path, cfg.list_size)
        valid_ds = QueryListDataset(cfg.valid_path, cfg.list_size)
        self.train_sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed)
        self.train_loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=self.train_sampler,
                                       num_workers=cfg.num_workers, pin_memory=True, drop_last=True)
        self.valid_loader = DataLoader(valid_ds, batch_size=cfg.batch_size * 2,
                                       sampler=DistributedSampler(valid_ds, shuffle=False),
                                       num_workers=cfg.num_workers, pin_memory=True)

        model = MLPScorer(cfg.num_features, cfg.hidden_dims, cfg.dropout).to(self.device)
        self.model = DDP(model, device_ids=[self.local_rank], output_device=self.local_rank)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.ckpt = CheckpointManager(cfg.output_dir, cfg.keep_last, self.is_main)
        self.start_epoch = 0
        self._maybe_resume()

    def _maybe_resume(self):
        latest = self.ckpt.latest()
        if latest is None:
            return
        state = torch.load(latest, map_location=self.device)
        self.model.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.start_epoch = state["epoch"] + 1
        if self.is_main:
            logger.info("resumed from %s (epoch %d)", latest, state["epoch"])

    @torch.no_grad()
    def evaluate(self):
        self.model.eval()
        totals = torch.zeros(2, device=self.device)
        for feats, labels, mask in self.valid_loader:
            feats, labels, mask = (t.to(self.device, non_blocking=True) for t in (feats, labels, mask))
            s, n = ndcg_at_k(self.model(feats), labels, mask)
            totals += torch.stack([s, n.float()])
        dist.all_reduce(totals)
        return {"ndcg@10": (totals[0] / totals[1].clamp(min=1)).item()}

    def fit(self):
        for epoch in range(self.start_epoch, self.cfg.epochs):
            self.model.train()
            t0 = time.time()
            running = torch.zeros(2, device=self.device)
            for feats, labels, mask in self.train_loader:
                feats, labels, mask = (t.to(self.device, non_blocking=True) for t in (feats, labels, mask))
                loss = listnet_loss(self.model(feats), labels, mask)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
                self.optimizer.step()
                running += torch.stack([loss.detach(), torch.ones((), device=self.device)])
            dist.all_reduce(running)
            metrics = self.evaluate()
            metrics["train_loss"] = (running[0] / running[1]).item()
            if self.is_main:
                logger.info("epoch %d %s (%.1fs)", epoch, json.dumps(metrics), time.time() - t0)
            self.ckpt.save(epoch, self.model, self.optimizer, metrics["ndcg@10"])
            for cb in self.callbacks:
                cb.on_epoch_end(self, epoch, metrics)
            if self.should_stop:
                if self.is_main:
                    logger.info("early stopping at epoch %d", epoch)
                break


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=None)
    args = parser.parse_args()
    cfg = RankerConfig.from_yaml(args.config)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    torch.manual_seed(cfg.seed)
    logging.basicConfig(level=logging.INFO if dist.get_rank() == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    if dist.get_rank() == 0:
        logger.info("config: %s", asdict(cfg))

    trainer = Trainer(cfg, callbacks=[EarlyStopping(cfg.patience)])
    try:
        trainer.fit()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
