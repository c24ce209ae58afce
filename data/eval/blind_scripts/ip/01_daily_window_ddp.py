#!/usr/bin/env python3
"""CTR model trained on a sliding window of daily impression logs.

Each day is a directory of parquet part files written by the nightly
feature job (dense_0..dense_12, cat_0..cat_25 already hashed, label).
The last day of the window is held out for evaluation.
"""
import argparse
import glob
import logging
import math
import os
import time
from datetime import date, timedelta

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

NUM_DENSE = 13
NUM_SPARSE = 26

log = logging.getLogger("ctr")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_root", default="/mnt/warehouse/ctr_features")
    p.add_argument("--end_date", default="2024-03-14")
    p.add_argument("--window_days", type=int, default=7)
    p.add_argument("--hash_size", type=int, default=200_000)
    p.add_argument("--emb_dim", type=int, default=32)
    p.add_argument("--bottom_mlp", default="256,128,32")
    p.add_argument("--top_mlp", default="512,256")
    p.add_argument("--batch_size", type=int, default=4096, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--num_workers", type=int, default=4)
    p.add_argument("--log_every", type=int, default=200)
    p.add_argument("--out_dir", default="/mnt/shared/ckpt/ctr_daily")
    return p.parse_args()


def day_dirs(root, end_date, n_days):
    end = date.fromisoformat(end_date)
    days = [end - timedelta(days=i) for i in range(n_days)][::-1]
    return [os.path.join(root, f"dt={d.isoformat()}") for d in days]


class ParquetDayStream(IterableDataset):
    """Streams rows from a list of parquet files as fixed-size batches."""

    def __init__(self, files, batch_size, hash_size, rank=0, world_size=1, shard_rows=False):
        self.files = sorted(files)
        self.batch_size = batch_size
        self.hash_size = hash_size
        self.rank = rank
        self.world_size = world_size
        self.shard_rows = shard_rows

    def _my_files(self):
        if self.shard_rows:
            return self.files
        return self.files[self.rank::self.world_size]

    def __iter__(self):
        files = self._my_files()
        info = get_worker_info()
        if info is not None:
            files = files[info.id::info.num_workers]
        dense_cols = [f"dense_{i}" for i in range(NUM_DENSE)]
        sparse_cols = [f"cat_{i}" for i in range(NUM_SPARSE)]
        for path in files:
            table = pq.read_table(path, columns=dense_cols + sparse_cols + ["label"])
            dense = np.stack([table[c].to_numpy(zero_copy_only=False) for c in dense_cols], 1)
            sparse = np.stack([table[c].to_numpy(zero_copy_only=False) for c in sparse_cols], 1)
            label = table["label"].to_numpy(zero_copy_only=False)
            if self.shard_rows:
                sel = np.arange(len(label)) % self.world_size == self.rank
                dense, sparse, label = dense[sel], sparse[sel], label[sel]
            dense = np.log1p(np.maximum(dense.astype(np.float32), 0.0))
            sparse = (sparse.astype(np.int64) % self.hash_size)
            for s in range(0, len(label) - self.batch_size + 1, self.batch_size):
                e = s + self.batch_size
                yield (torch.from_numpy(dense[s:e]),
                       torch.from_numpy(sparse[s:e]),
                       torch.from_numpy(label[s:e].astype(np.float32)))


def mlp(dims, last_act=True):
    layers = []
    for i in range(len(dims) - 1):
        layers.append(nn.Linear(dims[i], dims[i + 1]))
        if i < len(dims) - 2 or last_act:
            layers.append(nn.ReLU(inplace=True))
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    def __init__(self, hash_size, emb_dim, bottom, top):
        super().__init__()
        self.bottom = mlp([NUM_DENSE] + bottom)
        self.embs = nn.ModuleList([nn.Embedding(hash_size, emb_dim) for _ in range(NUM_SPARSE)])
        for e in self.embs:
            nn.init.uniform_(e.weight, -1.0 / math.sqrt(hash_size), 1.0 / math.sqrt(hash_size))
        n_feat = NUM_SPARSE + 1
        n_inter = n_feat * (n_feat - 1) // 2
        self.top = mlp([emb_dim + n_inter] + top + [1], last_act=False)

    def forward(self, dense, sparse):
        x = self.bottom(dense)
        feats = [x] + [emb(sparse[:, i]) for i, emb in enumerate(self.embs)]
        t = torch.stack(feats, dim=1)
        z = torch.bmm(t, t.transpose(1, 2))
        li, lj = torch.tril_indices(t.size(1), t.size(1), offset=-1, device=t.device)
        inter = z[:, li, lj]
        return self.top(torch.cat([x, inter], dim=1)).squeeze(1)


def auc_from_hist(pos, neg):
    pos, neg = pos.double(), neg.double()
    neg_below = torch.cumsum(neg, 0) - neg
    num = (pos * (neg_below + 0.5 * neg)).sum()
    den = pos.sum() * neg.sum()
    return (num / den).item() if den > 0 else float("nan")


@torch.no_grad()
def evaluate(model, loader, device, n_bins=10000):
    model.eval()
    pos_hist = torch.zeros(n_bins, device=device)
    neg_hist = torch.zeros(n_bins, device=device)
    stats = torch.zeros(2, device=device, dtype=torch.float64)
    for dense, sparse, label in loader:
        dense, sparse, label = dense.to(device), sparse.to(device), label.to(device)
        logit = model(dense, sparse)
        stats[0] += F.binary_cross_entropy_with_logits(logit, label, reduction="sum").double()
        stats[1] += label.numel()
        b = (torch.sigmoid(logit) * n_bins).long().clamp_(0, n_bins - 1)
        pos_hist += torch.bincount(b[label > 0.5], minlength=n_bins)
        neg_hist += torch.bincount(b[label <= 0.5], minlength=n_bins)
    for t in (pos_hist, neg_hist, stats):
        dist.all_reduce(t)
    model.train()
    return (stats[0] / stats[1]).item(), auc_from_hist(pos_hist, neg_hist)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(1234)

    dirs = day_dirs(args.data_root, args.end_date, args.window_days + 1)
    train_files = [f for d in dirs[:-1] for f in glob.glob(os.path.join(d, "*.parquet"))]
    eval_files = sorted(glob.glob(os.path.join(dirs[-1], "*.parquet")))
    log.info("train files: %d over %d days, eval files: %d",
             len(train_files), args.window_days, len(eval_files))

    train_ds = ParquetDayStream(train_files, args.batch_size, args.hash_size, rank, world_size)
    eval_ds = ParquetDayStream(eval_files, args.batch_size, args.hash_size, rank, world_size,
                               shard_rows=True)
    train_loader = DataLoader(train_ds, batch_size=None, num_workers=args.num_workers,
                              pin_memory=True, persistent_workers=True)
    eval_loader = DataLoader(eval_ds, batch_size=None, num_workers=2, pin_memory=True)

    model = DLRM(args.hash_size, args.emb_dim,
                 [int(x) for x in args.bottom_mlp.split(",")],
                 [int(x) for x in args.top_mlp.split(",")]).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    model.train()
    t0 = time.time()
    step = 0
    running = 0.0
    for dense, sparse, label in train_loader:
        dense = dense.to(device, non_blocking=True)
        sparse = sparse.to(device, non_blocking=True)
        label = label.to(device, non_blocking=True)
        logit = model(dense, sparse)
        loss = F.binary_cross_entropy_with_logits(logit, label)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        running += loss.item()
        step += 1
        if step % args.log_every == 0:
            dt = time.time() - t0
            log.info("step %d loss %.5f  %.0f samples/s/gpu", step, running / args.log_every,
                     args.log_every * args.batch_size / dt)
            running, t0 = 0.0, time.time()

    logloss, auc = evaluate(model.module, eval_loader, device)
    log.info("eval day %s: logloss %.5f auc %.5f", os.path.basename(dirs[-1]), logloss, auc)

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        torch.save({"model": model.module.state_dict(), "args": vars(args), "steps": step,
                    "eval": {"logloss": logloss, "auc": auc}},
                   os.path.join(args.out_dir, f"dlrm_{args.end_date}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
