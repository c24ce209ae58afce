"""DCN-v2 ranking model, data parallel over 8 GPUs.

Input: one parquet file per day, columns `I1..I13` (float), `C1..C26` (int64, already
hashed with murmur3 by the feature service), `label`.
"""
import argparse
import os
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

DENSE = [f"I{i}" for i in range(1, 14)]
SPARSE = [f"C{i}" for i in range(1, 27)]


def get_args():
    p = argparse.ArgumentParser(description="DCN-v2 CTR")
    p.add_argument("--train_days", nargs="+", required=True)
    p.add_argument("--valid_day", required=True)
    p.add_argument("--buckets", type=int, default=300_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--cross_layers", type=int, default=3)
    p.add_argument("--low_rank", type=int, default=64)
    p.add_argument("--deep", type=str, default="768,768")
    p.add_argument("--bs", type=int, default=1024)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--emb_l2", type=float, default=1e-5)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--output", type=Path, default=Path("/shared/exp/dcnv2"))
    return p.parse_args()


def load_days(paths, buckets):
    frames = [pd.read_parquet(p, columns=DENSE + SPARSE + ["label"]) for p in paths]
    df = pd.concat(frames, ignore_index=True)
    dense = np.log1p(df[DENSE].clip(lower=0).fillna(0).to_numpy(np.float32))
    sparse = (df[SPARSE].fillna(0).to_numpy(np.int64) % buckets)
    label = df["label"].to_numpy(np.float32)
    return TensorDataset(torch.from_numpy(dense), torch.from_numpy(sparse), torch.from_numpy(label))


class CrossLayer(nn.Module):
    def __init__(self, d, r):
        super().__init__()
        self.u = nn.Linear(d, r, bias=False)
        self.v = nn.Linear(r, d)

    def forward(self, x0, x):
        return x0 * self.v(self.u(x)) + x


class DCNv2(nn.Module):
    def __init__(self, n_sparse, buckets, dim, n_cross, low_rank, deep):
        super().__init__()
        self.tables = nn.ModuleList([nn.Embedding(buckets, dim) for _ in range(n_sparse)])
        for t in self.tables:
            nn.init.xavier_uniform_(t.weight)
        d_in = len(DENSE) + n_sparse * dim
        self.cross = nn.ModuleList([CrossLayer(d_in, low_rank) for _ in range(n_cross)])
        layers, prev = [], d_in
        for h in deep:
            layers += [nn.Linear(prev, h), nn.ReLU(), nn.Dropout(0.1)]
            prev = h
        self.deep = nn.Sequential(*layers)
        self.head = nn.Linear(prev + d_in, 1)

    def embed(self, sparse):
        return [t(sparse[:, i]) for i, t in enumerate(self.tables)]

    def embedding_l2(self, sparse):
        # only penalise the rows that appear in the batch
        return sum((e ** 2).sum(dim=1).mean() for e in self.embed(sparse))

    def forward(self, dense, sparse):
        x0 = torch.cat([dense] + self.embed(sparse), dim=1)
        x = x0
        for layer in self.cross:
            x = layer(x0, x)
        return self.head(torch.cat([x, self.deep(x0)], dim=1)).squeeze(1)


def roc_auc(scores, labels):
    order = torch.argsort(scores)
    labels = labels[order]
    ranks = torch.arange(1, len(labels) + 1, device=labels.device, dtype=torch.float64)
    n_pos = labels.sum()
    n_neg = len(labels) - n_pos
    return ((ranks * labels).sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


@torch.no_grad()
def validate(net, loader, device, world):
    net.eval()
    scores, labels = [], []
    for dense, sparse, y in loader:
        scores.append(torch.sigmoid(net(dense.to(device), sparse.to(device))).double())
        labels.append(y.to(device).double())
    scores, labels = torch.cat(scores), torch.cat(labels)
    # every rank has the same number of rows (see valid split below)
    all_s = [torch.empty_like(scores) for _ in range(world)]
    all_y = [torch.empty_like(labels) for _ in range(world)]
    dist.all_gather(all_s, scores)
    dist.all_gather(all_y, labels)
    s, y = torch.cat(all_s), torch.cat(all_y)
    logloss = F.binary_cross_entropy(s.clamp(1e-7, 1 - 1e-7), y).item()
    net.train()
    return logloss, roc_auc(s, y).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    train_ds = load_days(args.train_days, args.buckets)
    valid_ds = load_days([args.valid_day], args.buckets)
    per_rank = len(valid_ds) // world
    valid_part = torch.utils.data.Subset(valid_ds, range(rank * per_rank, (rank + 1) * per_rank))

    sampler = DistributedSampler(train_ds, shuffle=True, seed=42)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=4,
                              pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_part, batch_size=8192, num_workers=2)

    torch.manual_seed(42)
    net = DCNv2(len(SPARSE), args.buckets, args.dim, args.cross_layers, args.low_rank,
                [int(h) for h in args.deep.split(",")]).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    writer = SummaryWriter(log_dir=str(args.output / "tb")) if is_main else None
    if is_main:
        args.output.mkdir(parents=True, exist_ok=True)

    global_step = 0
    best_auc = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for dense, sparse, y in train_loader:
            dense = dense.to(device, non_blocking=True)
            sparse = sparse.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            logits = model(dense, sparse)
            loss = F.binary_cross_entropy_with_logits(logits, y)
            reg = model.embedding_l2(sparse)
            total = loss + args.emb_l2 * reg
            opt.zero_grad(set_to_none=True)
            total.backward()
            opt.step()
            global_step += 1
            if is_main and global_step % 100 == 0:
                writer.add_scalar("train/bce", loss.item(), global_step)
                writer.add_scalar("train/emb_l2", reg.item(), global_step)
                writer.add_scalar("train/ex_per_s", 100 * args.bs * world / (time.time() - tic),
                                  global_step)
                tic = time.time()

        logloss, auc = validate(model.module, valid_loader, device, world)
        if is_main:
            print(f"epoch {epoch}: valid logloss={logloss:.5f} auc={auc:.5f}", flush=True)
            writer.add_scalar("valid/logloss", logloss, epoch)
            writer.add_scalar("valid/auc", auc, epoch)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                     "epoch": epoch, "auc": auc, "args": vars(args)}
            torch.save(state, args.output / "last.pt")
            if auc > best_auc:
                best_auc = auc
                torch.save(state, args.output / "best.pt")
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
