#!/usr/bin/env python3
"""DLRM on Criteo-style click logs stored as parquet.

Dense features: 13 integer counters (log1p-transformed here).
Sparse features: 26 categorical ids, already hashed into [0, num_embeddings)
by the upstream preprocessing job.

    torchrun --nproc_per_node=8 01_dlrm_criteo_auc.py \
        --train_dir /data/criteo/parquet/train --val_dir /data/criteo/parquet/val
"""
import argparse
import glob
import json
import logging
import math
import os
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import log_loss, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DENSE_COLS = [f"I{i}" for i in range(1, 14)]
SPARSE_COLS = [f"C{i}" for i in range(1, 27)]
LABEL_COL = "label"

logger = logging.getLogger("dlrm")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train_dir", required=True)
    p.add_argument("--val_dir", required=True)
    p.add_argument("--output_dir", default="./runs/dlrm_criteo")
    p.add_argument("--num_embeddings", type=int, default=500_000, help="rows per table (hash size)")
    p.add_argument("--embedding_dim", type=int, default=64)
    p.add_argument("--bottom_mlp", default="512,256,64")
    p.add_argument("--top_mlp", default="1024,1024,512,256,1")
    p.add_argument("--global_batch_size", type=int, default=32768)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--num_workers", type=int, default=6)
    p.add_argument("--eval_every", type=int, default=2000)
    p.add_argument("--log_every", type=int, default=100)
    p.add_argument("--amp", action="store_true")
    return p.parse_args()


class CriteoParquet(Dataset):
    def __init__(self, data_dir):
        files = sorted(glob.glob(os.path.join(data_dir, "*.parquet")))
        if not files:
            raise FileNotFoundError(f"no parquet files under {data_dir}")
        cols = DENSE_COLS + SPARSE_COLS + [LABEL_COL]
        table = pa.concat_tables([pq.read_table(f, columns=cols) for f in files])
        dense = np.stack(
            [table.column(c).to_numpy(zero_copy_only=False) for c in DENSE_COLS], axis=1
        ).astype(np.float32)
        dense = np.nan_to_num(dense, nan=0.0)
        self.dense = np.log1p(np.clip(dense, 0.0, None))
        self.sparse = np.stack(
            [table.column(c).to_numpy(zero_copy_only=False).astype(np.int64) for c in SPARSE_COLS], axis=1
        )
        self.labels = table.column(LABEL_COL).to_numpy(zero_copy_only=False).astype(np.float32)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, idx):
        return (
            torch.from_numpy(self.dense[idx]),
            torch.from_numpy(self.sparse[idx]),
            torch.tensor(self.labels[idx]),
        )


def mlp(sizes, in_dim, last_act=True):
    layers = []
    for i, s in enumerate(sizes):
        layers.append(nn.Linear(in_dim, s))
        if i < len(sizes) - 1 or last_act:
            layers.append(nn.ReLU(inplace=True))
        in_dim = s
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    def __init__(self, num_dense, num_sparse, num_embeddings, dim, bottom, top):
        super().__init__()
        assert bottom[-1] == dim, "bottom MLP must end at the embedding dim"
        self.embeddings = nn.ModuleList(
            [nn.Embedding(num_embeddings, dim) for _ in range(num_sparse)]
        )
        bound = 1.0 / math.sqrt(num_embeddings)
        for emb in self.embeddings:
            nn.init.uniform_(emb.weight, -bound, bound)
        self.bottom = mlp(bottom, num_dense)
        n = num_sparse + 1
        self.top = mlp(top, dim + n * (n - 1) // 2, last_act=False)
        li, lj = torch.triu_indices(n, n, offset=1)
        self.register_buffer("li", li, persistent=False)
        self.register_buffer("lj", lj, persistent=False)

    def forward(self, dense, sparse):
        x = self.bottom(dense)
        feats = [x] + [emb(sparse[:, i]) for i, emb in enumerate(self.embeddings)]
        T = torch.stack(feats, dim=1)
        Z = torch.bmm(T, T.transpose(1, 2))
        inter = Z[:, self.li, self.lj]
        return self.top(torch.cat([x, inter], dim=1)).squeeze(1)


@torch.no_grad()
def evaluate(model, loader, device, amp):
    model.eval()
    preds, labels = [], []
    for dense, sparse, y in loader:
        dense = dense.to(device, non_blocking=True)
        sparse = sparse.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            logits = model(dense, sparse)
        preds.append(torch.sigmoid(logits.float()).cpu())
        labels.append(y)
    model.train()
    p = torch.cat(preds).numpy()
    y = torch.cat(labels).numpy()
    return {"auc": roc_auc_score(y, p), "logloss": log_loss(y, p, labels=[0, 1])}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(message)s",
    )
    torch.manual_seed(1234)
    np.random.seed(1234)

    assert args.global_batch_size % world_size == 0
    per_gpu_batch = args.global_batch_size // world_size

    train_ds = CriteoParquet(args.train_dir)
    val_ds = CriteoParquet(args.val_dir)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=1234, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(
        train_ds, batch_size=per_gpu_batch, sampler=train_sampler,
        num_workers=args.num_workers, pin_memory=True, drop_last=True, persistent_workers=True,
    )
    val_loader = DataLoader(
        val_ds, batch_size=per_gpu_batch, sampler=val_sampler,
        num_workers=args.num_workers, pin_memory=True,
    )
    logger.info("train rows=%d val rows=%d per_gpu_batch=%d", len(train_ds), len(val_ds), per_gpu_batch)

    bottom = [int(x) for x in args.bottom_mlp.split(",")]
    top = [int(x) for x in args.top_mlp.split(",")]
    model = DLRM(len(DENSE_COLS), len(SPARSE_COLS), args.num_embeddings, args.embedding_dim, bottom, top)
    model = model.to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    optimizer = torch.optim.Adagrad(model.parameters(), lr=args.lr)
    os.makedirs(args.output_dir, exist_ok=True)
    if rank == 0:
        with open(os.path.join(args.output_dir, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    best_auc = 0.0
    step = 0
    t0 = time.time()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        running = torch.zeros(2, device=device)
        for dense, sparse, y in train_loader:
            dense = dense.to(device, non_blocking=True)
            sparse = sparse.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.amp):
                logits = model(dense, sparse)
            loss = F.binary_cross_entropy_with_logits(logits.float(), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            running += torch.stack([loss.detach(), torch.ones((), device=device)])

            if step % args.log_every == 0:
                dist.all_reduce(running)
                avg = (running[0] / running[1]).item()
                dt = time.time() - t0
                logger.info(
                    "epoch %d step %d loss %.5f %.0f samples/s",
                    epoch, step, avg, args.log_every * args.global_batch_size / dt,
                )
                running.zero_()
                t0 = time.time()

            if step % args.eval_every == 0:
                metrics = evaluate(model, val_loader, device, args.amp)
                if rank == 0:
                    logger.info("step %d val auc %.5f logloss %.5f", step, metrics["auc"], metrics["logloss"])
                    if metrics["auc"] > best_auc:
                        best_auc = metrics["auc"]
                        torch.save(
                            {"model": model.module.state_dict(), "step": step, "auc": best_auc},
                            os.path.join(args.output_dir, "best.pt"),
                        )
                dist.barrier()
                t0 = time.time()

    metrics = evaluate(model, val_loader, device, args.amp)
    if rank == 0:
        logger.info("final val auc %.5f logloss %.5f (best %.5f)", metrics["auc"], metrics["logloss"], best_auc)
        torch.save(
            {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
            os.path.join(args.output_dir, "last.pt"),
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
