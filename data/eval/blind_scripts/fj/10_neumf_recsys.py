#!/usr/bin/env python
"""NeuMF recommender for the e-commerce "you may also like" rail.

Implicit feedback, 4 sampled negatives per positive, leave-one-out eval with
99 pre-sampled negatives per user (HR@10 / NDCG@10).

    torchrun --standalone --nproc_per_node=4 10_neumf_recsys.py --data data/interactions --epochs 20
"""
import argparse
import logging
import math
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

logger = logging.getLogger("neumf")


# -------------------------------------------------------------------- data
class TrainInteractions(Dataset):
    """Positives from the train split; negatives are re-drawn every epoch."""

    def __init__(self, pairs, n_items, num_neg=4):
        self.pairs = pairs  # (N, 2) user, item
        self.n_items = n_items
        self.num_neg = num_neg
        self.seen = {}
        for u, i in pairs:
            self.seen.setdefault(int(u), set()).add(int(i))
        self.resample(0)

    def resample(self, seed):
        rng = np.random.default_rng(seed)
        users = np.repeat(self.pairs[:, 0], self.num_neg)
        negs = rng.integers(0, self.n_items, size=len(users))
        for k, (u, j) in enumerate(zip(users, negs)):
            while j in self.seen[int(u)]:
                j = rng.integers(0, self.n_items)
            negs[k] = j
        self.users = np.concatenate([self.pairs[:, 0], users])
        self.items = np.concatenate([self.pairs[:, 1], negs])
        self.labels = np.concatenate([np.ones(len(self.pairs)), np.zeros(len(users))]).astype(np.float32)

    def __len__(self):
        return len(self.users)

    def __getitem__(self, k):
        return self.users[k], self.items[k], self.labels[k]


class LeaveOneOut(Dataset):
    def __init__(self, test_pairs, test_negs):
        self.test_pairs, self.test_negs = test_pairs, test_negs  # (U, 2), (U, 99)

    def __len__(self):
        return len(self.test_pairs)

    def __getitem__(self, k):
        u, pos = self.test_pairs[k]
        items = np.concatenate([[pos], self.test_negs[k]]).astype(np.int64)
        return np.full(len(items), u, dtype=np.int64), items


# -------------------------------------------------------------------- model
class NeuMF(nn.Module):
    def __init__(self, n_users, n_items, gmf_dim=32, mlp_dims=(128, 64, 32), dropout=0.1):
        super().__init__()
        self.gmf_u = nn.Embedding(n_users, gmf_dim)
        self.gmf_i = nn.Embedding(n_items, gmf_dim)
        self.mlp_u = nn.Embedding(n_users, mlp_dims[0] // 2)
        self.mlp_i = nn.Embedding(n_items, mlp_dims[0] // 2)
        layers = []
        for a, b in zip(mlp_dims[:-1], mlp_dims[1:]):
            layers += [nn.Linear(a, b), nn.ReLU(), nn.Dropout(dropout)]
        self.mlp = nn.Sequential(*layers)
        self.out = nn.Linear(gmf_dim + mlp_dims[-1], 1)
        for emb in (self.gmf_u, self.gmf_i, self.mlp_u, self.mlp_i):
            nn.init.normal_(emb.weight, std=0.01)

    def forward(self, u, i):
        gmf = self.gmf_u(u) * self.gmf_i(i)
        mlp = self.mlp(torch.cat([self.mlp_u(u), self.mlp_i(i)], dim=-1))
        return self.out(torch.cat([gmf, mlp], dim=-1)).squeeze(-1)


# -------------------------------------------------------------------- metrics
class MetricAccumulator:
    """Running sums kept on the host so per-step logging never blocks the GPU."""

    def __init__(self, *names):
        self.names = names
        self.reset()

    def reset(self):
        self.sums = torch.zeros(len(self.names), dtype=torch.float64)
        self.count = torch.zeros(1, dtype=torch.float64)

    def update(self, n, **values):
        for k, name in enumerate(self.names):
            self.sums[k] += float(values[name]) * n
        self.count += n

    def compute(self):
        buf = torch.cat([self.sums, self.count])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(buf, op=dist.ReduceOp.SUM)
        return {name: (buf[k] / buf[-1].clamp(min=1)).item() for k, name in enumerate(self.names)}


# -------------------------------------------------------------------- callbacks
class Callback:
    def on_epoch_end(self, trainer, logs): pass


class ModelCheckpoint(Callback):
    def __init__(self, out_dir, monitor="ndcg@10"):
        self.out_dir, self.monitor, self.best = Path(out_dir), monitor, -1.0

    def on_epoch_end(self, trainer, logs):
        if trainer.rank == 0 and logs[self.monitor] > self.best:
            self.best = logs[self.monitor]
            self.out_dir.mkdir(parents=True, exist_ok=True)
            torch.save({"model": trainer.model.module.state_dict(), "epoch": trainer.epoch, **logs},
                       self.out_dir / "neumf_best.pt")


class EarlyStopping(Callback):
    def __init__(self, monitor="ndcg@10", patience=3):
        self.monitor, self.patience, self.best, self.bad = monitor, patience, -1.0, 0

    def on_epoch_end(self, trainer, logs):
        if logs[self.monitor] > self.best + 1e-4:
            self.best, self.bad = logs[self.monitor], 0
        else:
            self.bad += 1
            trainer.stop = self.bad >= self.patience


class LRMonitor(Callback):
    def on_epoch_end(self, trainer, logs):
        logs["lr"] = trainer.optimizer.param_groups[0]["lr"]


# -------------------------------------------------------------------- trainer
class Trainer:
    def __init__(self, model, optimizer, device, callbacks, clip_grad=None):
        self.device = device
        self.rank = dist.get_rank()
        self.model = DDP(model.to(device), device_ids=[device.index])
        self.optimizer = optimizer
        self.callbacks = callbacks
        self.clip_grad = clip_grad
        self.epoch, self.stop = 0, False

    def train_epoch(self, loader):
        self.model.train()
        acc = MetricAccumulator("loss")
        for u, i, y in loader:
            u, i, y = u.to(self.device), i.to(self.device), y.to(self.device)
            loss = F.binary_cross_entropy_with_logits(self.model(u, i), y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if self.clip_grad:
                nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad)
            self.optimizer.step()
            acc.update(y.numel(), loss=loss.item())
        return {f"train_{k}": v for k, v in acc.compute().items()}

    @torch.no_grad()
    def evaluate(self, loader, k=10):
        net = self.model.module.eval()
        acc = MetricAccumulator("hr@10", "ndcg@10")
        for users, items in loader:
            scores = net(users.to(self.device), items.to(self.device))  # (B, 100); column 0 is the positive
            rank_of_pos = (scores > scores[:, :1]).sum(dim=1)
            hit = (rank_of_pos < k).float()
            ndcg = hit / torch.log2(rank_of_pos.float() + 2)
            acc.update(users.size(0), **{"hr@10": hit.mean().item(), "ndcg@10": ndcg.mean().item()})
        return acc.compute()

    def fit(self, train_ds, train_loader, val_loader, epochs):
        for epoch in range(epochs):
            self.epoch = epoch
            train_ds.resample(seed=epoch)
            train_loader.sampler.set_epoch(epoch)
            logs = self.train_epoch(train_loader)
            logs.update(self.evaluate(val_loader))
            if self.rank == 0:
                logger.info("epoch %2d  %s", epoch, "  ".join(f"{k} {v:.4f}" for k, v in logs.items()))
            for cb in self.callbacks:
                cb.on_epoch_end(self, logs)
            if self.stop:
                break


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--num-neg", type=int, default=4)
    ap.add_argument("--out", default="runs/neumf")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")

    data = Path(args.data)
    meta = np.load(data / "meta.npz")
    n_users, n_items = int(meta["n_users"]), int(meta["n_items"])
    train_pairs = np.load(data / "train_pairs.npy")
    test_pairs, test_negs = np.load(data / "test_pairs.npy"), np.load(data / "test_negatives.npy")

    train_ds = TrainInteractions(train_pairs, n_items, args.num_neg)
    val_ds = LeaveOneOut(test_pairs, test_negs)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=DistributedSampler(train_ds),
                              num_workers=4, pin_memory=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)),
                            batch_size=1024, num_workers=2)

    torch.manual_seed(2024)
    model = NeuMF(n_users, n_items)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    callbacks = [LRMonitor(), ModelCheckpoint(args.out), EarlyStopping()]
    trainer = Trainer(model, optimizer, device, callbacks, clip_grad=None)
    trainer.fit(train_ds, train_loader, val_loader, args.epochs)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
