#!/usr/bin/env python3
"""DLRM trainer for the marketplace ranking model (hashed features, 7-day window).

    torchrun --nproc_per_node=8 11_dlrm_trainer_class.py --train-days 7 --eval-date 2024-09-02
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import time
from dataclasses import dataclass, field
from datetime import date, timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("dlrm")


@dataclass
class TrainConfig:
    data_root: str = "/datasets/marketplace/daily"
    eval_date: str = "2024-09-02"
    train_days: int = 7
    num_dense: int = 16
    table_rows: list = field(default_factory=lambda: [1_000_000] * 4 + [100_000] * 12 + [10_000] * 8)
    emb_dim: int = 48
    bottom: tuple = (256, 128)
    top: tuple = (512, 256, 128)
    batch_size: int = 4096
    lr: float = 2e-3
    num_workers: int = 8
    ckpt_dir: str = "/datasets/marketplace/checkpoints/dlrm"


def to_device(batch, device="cuda:0"):
    return tuple(t.to(device, non_blocking=True) for t in batch)


class DailyShard(Dataset):
    def __init__(self, path, table_rows):
        arr = np.load(path)
        self.dense = arr["dense"].astype(np.float32)
        self.sparse = arr["sparse"].astype(np.int64) % np.asarray(table_rows, dtype=np.int64)
        self.label = arr["label"].astype(np.float32)

    def __len__(self):
        return self.label.shape[0]

    def __getitem__(self, idx):
        return (torch.from_numpy(self.dense[idx]), torch.from_numpy(self.sparse[idx]),
                torch.tensor(self.label[idx]))


class DLRM(nn.Module):
    def __init__(self, cfg: TrainConfig):
        super().__init__()
        dims = [cfg.num_dense, *cfg.bottom, cfg.emb_dim]
        self.bottom_mlp = nn.Sequential(*[m for i in range(len(dims) - 1)
                                          for m in (nn.Linear(dims[i], dims[i + 1]), nn.ReLU())])
        self.tables = nn.ModuleList(nn.Embedding(r, cfg.emb_dim) for r in cfg.table_rows)
        n = len(cfg.table_rows) + 1
        tdims = [cfg.emb_dim + n * (n - 1) // 2, *cfg.top]
        layers = [m for i in range(len(tdims) - 1) for m in (nn.Linear(tdims[i], tdims[i + 1]), nn.ReLU())]
        self.top_mlp = nn.Sequential(*layers, nn.Linear(tdims[-1], 1))
        self.register_buffer("tri", torch.stack(torch.tril_indices(n, n, -1)), persistent=False)

    def forward(self, dense, sparse):
        x = self.bottom_mlp(dense)
        embs = torch.stack([x] + [t(sparse[:, i]) for i, t in enumerate(self.tables)], 1)
        inter = torch.bmm(embs, embs.transpose(1, 2))[:, self.tri[0], self.tri[1]]
        return self.top_mlp(torch.cat([x, inter], 1)).squeeze(1)


class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)

        end = date.fromisoformat(cfg.eval_date)
        train_paths = [os.path.join(cfg.data_root, f"{end - timedelta(days=k)}.npz")
                       for k in range(cfg.train_days, 0, -1)]
        self.train_ds = ConcatDataset([DailyShard(p, cfg.table_rows) for p in train_paths])
        eval_ds = DailyShard(os.path.join(cfg.data_root, f"{end}.npz"), cfg.table_rows)
        n = len(eval_ds) // self.world
        self.eval_ds = torch.utils.data.Subset(eval_ds, range(self.rank * n, (self.rank + 1) * n))

        self.sampler = DistributedSampler(self.train_ds, shuffle=True, seed=0, drop_last=True)
        self.train_loader = DataLoader(self.train_ds, batch_size=cfg.batch_size, sampler=self.sampler,
                                       num_workers=cfg.num_workers, pin_memory=True, drop_last=True)
        self.eval_loader = DataLoader(self.eval_ds, batch_size=cfg.batch_size * 4,
                                      num_workers=4, pin_memory=True)

        torch.manual_seed(0)
        self.model = DDP(DLRM(cfg).to(self.device), device_ids=[self.local_rank])
        self.opt = torch.optim.Adam(self.model.parameters(), lr=cfg.lr)

    def train_epoch(self, epoch):
        self.model.train()
        self.sampler.set_epoch(epoch)
        t0, total, n = time.time(), 0.0, 0
        for i, batch in enumerate(self.train_loader):
            dense, sparse, label = to_device(batch, self.device)
            loss = F.binary_cross_entropy_with_logits(self.model(dense, sparse), label)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            total += loss.item()
            n += 1
            if i % 500 == 0:
                logger.info("epoch %d iter %d/%d loss %.4f", epoch, i, len(self.train_loader), total / n)
        stats = torch.tensor([total, n], device=self.device, dtype=torch.float64)
        dist.all_reduce(stats)
        return (stats[0] / stats[1]).item(), time.time() - t0

    @torch.no_grad()
    def evaluate(self):
        net = self.model.module
        net.eval()
        preds, labels = [], []
        for batch in self.eval_loader:
            dense, sparse, label = to_device(batch)
            preds.append(torch.sigmoid(net(dense, sparse)))
            labels.append(label)
        p = torch.cat(preds)
        y = torch.cat(labels)
        all_p = [torch.empty_like(p) for _ in range(self.world)]
        all_y = [torch.empty_like(y) for _ in range(self.world)]
        dist.all_gather(all_p, p)
        dist.all_gather(all_y, y)
        net.train()
        if self.rank != 0:
            return None
        p, y = torch.cat(all_p).double(), torch.cat(all_y).double()
        logloss = F.binary_cross_entropy(p.clamp(1e-7, 1 - 1e-7), y).item()
        order = torch.argsort(p)
        ranks = torch.empty_like(p)
        ranks[order] = torch.arange(1, len(p) + 1, device=p.device, dtype=p.dtype)
        n_pos = y.sum()
        auc = ((ranks * y).sum() - n_pos * (n_pos + 1) / 2) / (n_pos * (len(y) - n_pos))
        return {"logloss": logloss, "auc": auc.item()}

    def save(self, epoch, metrics):
        if self.rank == 0:
            os.makedirs(self.cfg.ckpt_dir, exist_ok=True)
            torch.save({"model": self.model.module.state_dict(), "opt": self.opt.state_dict(),
                        "epoch": epoch, "metrics": metrics},
                       os.path.join(self.cfg.ckpt_dir, f"dlrm_{self.cfg.eval_date}_ep{epoch}.pt"))
        dist.barrier()

    def close(self):
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-days", type=int, default=7)
    ap.add_argument("--eval-date", default="2024-09-02")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=2e-3)
    a = ap.parse_args()
    cfg = TrainConfig(train_days=a.train_days, eval_date=a.eval_date, lr=a.lr)

    trainer = Trainer(cfg)
    logging.basicConfig(level=logging.INFO if trainer.rank == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s")
    for epoch in range(a.epochs):
        train_loss, secs = trainer.train_epoch(epoch)
        metrics = trainer.evaluate()
        if trainer.rank == 0:
            metrics.update(train_loss=train_loss, epoch_seconds=secs)
            logger.info("epoch %d %s", epoch, json.dumps(metrics))
        trainer.save(epoch, metrics)
    trainer.close()


if __name__ == "__main__":
    main()
