"""DLRM click model with an auxiliary pairwise ranking term.

Trains on day-partitioned parquet logs (one folder per day, e.g.
/data/ctr/logs/day=2023-05-01/part-*.parquet). Categorical columns are already
hashed into [0, table_size) by the upstream ETL job.
"""
import argparse
import glob
import json
import logging
import math
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("dlrm")

DENSE_COLS = [f"i{i}" for i in range(1, 14)]
SPARSE_COLS = [f"c{i}" for i in range(1, 27)]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", default="/data/ctr/logs")
    p.add_argument("--train-days", default="2023-05-01:2023-05-06")
    p.add_argument("--eval-day", default="2023-05-07")
    p.add_argument("--table-sizes", default="configs/table_sizes.json")
    p.add_argument("--emb-dim", type=int, default=64)
    p.add_argument("--bottom-mlp", default="512,256,64")
    p.add_argument("--top-mlp", default="1024,1024,512,256,1")
    p.add_argument("--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--pair-weight", type=float, default=0.3)
    p.add_argument("--num-workers", type=int, default=6)
    p.add_argument("--out-dir", default="/mnt/shared/runs/dlrm_pairwise")
    p.add_argument("--log-every", type=int, default=200)
    return p.parse_args()


def day_range(spec):
    start, end = spec.split(":")
    days = pd.date_range(start, end, freq="D")
    return [d.strftime("%Y-%m-%d") for d in days]


def load_days(root, days):
    frames = []
    for day in days:
        files = sorted(glob.glob(os.path.join(root, f"day={day}", "*.parquet")))
        frames.extend(pd.read_parquet(f, columns=["label"] + DENSE_COLS + SPARSE_COLS) for f in files)
    return pd.concat(frames, ignore_index=True)


class CTRFrame(Dataset):
    def __init__(self, df):
        dense = df[DENSE_COLS].fillna(0).to_numpy(dtype=np.float32)
        self.dense = np.log1p(np.clip(dense, 0, None))
        self.sparse = df[SPARSE_COLS].to_numpy(dtype=np.int64)
        self.label = df["label"].to_numpy(dtype=np.float32)

    def __len__(self):
        return len(self.label)

    def __getitem__(self, idx):
        return self.dense[idx], self.sparse[idx], self.label[idx]


def mlp(sizes, final_act=True):
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2 or final_act:
            layers.append(nn.ReLU(inplace=True))
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    def __init__(self, table_sizes, emb_dim, bottom, top):
        super().__init__()
        self.embs = nn.ModuleList(nn.EmbeddingBag(n, emb_dim, mode="sum") for n in table_sizes)
        for e in self.embs:
            nn.init.uniform_(e.weight, -1.0 / math.sqrt(e.num_embeddings), 1.0 / math.sqrt(e.num_embeddings))
        self.bottom = mlp([len(DENSE_COLS)] + bottom)
        n_feat = len(table_sizes) + 1
        n_inter = n_feat * (n_feat - 1) // 2
        self.top = mlp([emb_dim + n_inter] + top, final_act=False)
        self.register_buffer("tri", torch.triu_indices(n_feat, n_feat, offset=1), persistent=False)

    def forward(self, dense, sparse):
        x = self.bottom(dense)
        B = sparse.size(0)
        offsets = torch.arange(B, device=sparse.device)
        ly = [emb(sparse[:, i], offsets) for i, emb in enumerate(self.embs)]
        T = torch.stack([x] + ly, dim=1)
        Z = torch.bmm(T, T.transpose(1, 2))
        inter = Z[:, self.tri[0], self.tri[1]]
        return self.top(torch.cat([x, inter], dim=1)).squeeze(1)


def pairwise_logistic(logits, labels):
    pos = logits[labels > 0.5]
    neg = logits[labels <= 0.5]
    diff = pos.unsqueeze(1) - neg.unsqueeze(0)
    return F.softplus(-diff).mean()


@torch.no_grad()
def evaluate(model, loader, device, world_size, n_total):
    model.eval()
    preds, labels = [], []
    for dense, sparse, label in loader:
        logits = model(dense.to(device, non_blocking=True), sparse.to(device, non_blocking=True))
        preds.append(torch.sigmoid(logits))
        labels.append(label.to(device))
    preds = torch.cat(preds)
    labels = torch.cat(labels)
    out_p = [torch.empty_like(preds) for _ in range(world_size)]
    out_l = [torch.empty_like(labels) for _ in range(world_size)]
    dist.all_gather(out_p, preds)
    dist.all_gather(out_l, labels)
    # DistributedSampler(shuffle=False) interleaves indices, undo that and drop the padding
    p = torch.stack(out_p, dim=1).flatten()[:n_total].cpu().numpy()
    y = torch.stack(out_l, dim=1).flatten()[:n_total].cpu().numpy()
    model.train()
    return roc_auc_score(y, p), float(F.binary_cross_entropy(torch.from_numpy(p), torch.from_numpy(y)))


def main():
    args = parse_args()
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [%(levelname)s] %(message)s")
    torch.manual_seed(1234)

    with open(args.table_sizes) as f:
        table_sizes = [json.load(f)[c] for c in SPARSE_COLS]

    train_ds = CTRFrame(load_days(args.data_root, day_range(args.train_days)))
    eval_ds = CTRFrame(load_days(args.data_root, [args.eval_day]))
    logger.info("train rows %d, eval rows %d", len(train_ds), len(eval_ds))

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=1234)
    eval_sampler = DistributedSampler(eval_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    eval_loader = DataLoader(eval_ds, batch_size=4096, sampler=eval_sampler,
                             num_workers=args.num_workers, pin_memory=True)

    model = DLRM(table_sizes, args.emb_dim,
                 [int(x) for x in args.bottom_mlp.split(",")],
                 [int(x) for x in args.top_mlp.split(",")]).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.Adagrad(model.parameters(), lr=args.lr * world_size)

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)

    step = 0
    best_auc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for dense, sparse, label in train_loader:
            dense = dense.to(device, non_blocking=True)
            sparse = sparse.to(device, non_blocking=True)
            label = label.to(device, non_blocking=True)

            n_pos = int(label.sum().item())
            if n_pos == 0 or n_pos == label.numel():
                # the pairwise term needs at least one click and one non-click
                continue

            logits = model(dense, sparse)
            bce = F.binary_cross_entropy_with_logits(logits, label)
            loss = bce + args.pair_weight * pairwise_logistic(logits, label)

            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1

            if step % args.log_every == 0 and rank == 0:
                dt = time.time() - t0
                logger.info("epoch %d step %d loss %.5f bce %.5f  %.1f samples/s",
                            epoch, step, loss.item(), bce.item(),
                            args.log_every * args.batch_size * world_size / dt)
                t0 = time.time()

        auc, logloss = evaluate(model, eval_loader, device, world_size, len(eval_ds))
        if rank == 0:
            logger.info("epoch %d eval auc %.5f logloss %.5f", epoch, auc, logloss)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                     "epoch": epoch, "step": step, "auc": auc}
            torch.save(state, os.path.join(args.out_dir, "last.pt"))
            if auc > best_auc:
                best_auc = auc
                torch.save(state, os.path.join(args.out_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
