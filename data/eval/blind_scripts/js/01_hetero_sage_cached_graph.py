#!/usr/bin/env python
"""Heterogeneous GraphSAGE for card-not-present fraud.

Graph: transaction <-> card, transaction <-> merchant, transaction <-> device.
Target: is_fraud on transaction nodes. Temporal split on event timestamp.

    torchrun --nproc_per_node=4 01_hetero_sage_cached_graph.py --data /data/fraud/txn.parquet
"""
import argparse
import json
import logging
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch_geometric.transforms as T
from sklearn.metrics import average_precision_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.data import HeteroData
from torch_geometric.loader import NeighborLoader
from torch_geometric.nn import HeteroConv, SAGEConv

log = logging.getLogger("hetero_sage")

NUMERIC_COLS = ["amount", "amount_log", "hour", "dow", "mcc_risk", "card_age_days", "dist_home_km"]
ENTITY_COLS = [("card", "card_id"), ("merchant", "merchant_id"), ("device", "device_id")]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/fraud/txn.parquet")
    p.add_argument("--cache-dir", default="/data/fraud/cache")
    p.add_argument("--out", default="runs/hetero_sage")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--fanout", type=int, nargs="+", default=[15, 10])
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--wd", type=float, default=1e-5)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--val-start", default="2023-10-01")
    p.add_argument("--test-start", default="2023-11-15")
    p.add_argument("--patience", type=int, default=4)
    p.add_argument("--num-workers", type=int, default=4)
    return p.parse_args()


def build_graph(path, val_start, test_start):
    df = pd.read_parquet(path)
    df = df.sort_values("event_ts", kind="stable").reset_index(drop=True)
    ts = pd.to_datetime(df["event_ts"])
    df["amount_log"] = np.log1p(df["amount"].clip(lower=0))
    df["hour"] = ts.dt.hour / 23.0
    df["dow"] = ts.dt.dayofweek / 6.0

    data = HeteroData()
    x = torch.tensor(df[NUMERIC_COLS].fillna(0.0).values, dtype=torch.float)
    train_rows = torch.tensor((ts < pd.Timestamp(val_start)).values)
    mu, sd = x[train_rows].mean(0), x[train_rows].std(0) + 1e-6
    data["transaction"].x = (x - mu) / sd
    data["transaction"].y = torch.tensor(df["is_fraud"].values, dtype=torch.long)
    data["transaction"].train_mask = train_rows
    data["transaction"].val_mask = torch.tensor(((ts >= val_start) & (ts < test_start)).values)
    data["transaction"].test_mask = torch.tensor((ts >= test_start).values)

    txn = torch.arange(len(df))
    for ntype, col in ENTITY_COLS:
        codes, uniques = pd.factorize(df[col])
        codes = torch.from_numpy(codes).long()
        deg = torch.bincount(codes, minlength=len(uniques)).float()
        data[ntype].x = torch.stack([torch.log1p(deg), torch.ones_like(deg)], dim=1)
        data["transaction", f"at_{ntype}", ntype].edge_index = torch.stack([txn, codes])

    data = T.ToUndirected()(data)
    return data


class HeteroSAGE(nn.Module):
    def __init__(self, metadata, in_dims, hidden, dropout):
        super().__init__()
        node_types, edge_types = metadata
        self.proj = nn.ModuleDict({nt: nn.Linear(in_dims[nt], hidden) for nt in node_types})
        self.conv1 = HeteroConv({et: SAGEConv((hidden, hidden), hidden) for et in edge_types}, aggr="sum")
        # second hop only needs to update transaction nodes
        self.conv2 = HeteroConv(
            {et: SAGEConv((hidden, hidden), hidden) for et in edge_types if et[2] == "transaction"},
            aggr="sum",
        )
        self.head = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 1))
        self.dropout = dropout

    def forward(self, x_dict, edge_index_dict):
        h = {nt: F.relu(self.proj[nt](x)) for nt, x in x_dict.items()}
        h = self.conv1(h, edge_index_dict)
        h = {nt: F.dropout(F.relu(v), self.dropout, self.training) for nt, v in h.items()}
        h = self.conv2(h, edge_index_dict)
        return self.head(F.relu(h["transaction"])).squeeze(-1)


@torch.no_grad()
def evaluate(model, data, idx, args, device, rank, world):
    model.eval()
    loader = NeighborLoader(
        data,
        num_neighbors=args.fanout,
        input_nodes=("transaction", idx[rank::world]),
        batch_size=4096,
        shuffle=False,
        num_workers=args.num_workers,
    )
    scores, labels = [], []
    for batch in loader:
        batch = batch.to(device, non_blocking=True)
        bs = batch["transaction"].batch_size
        logits = model.module(batch.x_dict, batch.edge_index_dict)[:bs]
        scores.append(torch.sigmoid(logits).float().cpu())
        labels.append(batch["transaction"].y[:bs].cpu())
    local = (torch.cat(scores).numpy(), torch.cat(labels).numpy())
    gathered = [None] * world
    dist.all_gather_object(gathered, local)
    s = np.concatenate([g[0] for g in gathered])
    y = np.concatenate([g[1] for g in gathered])
    return {"pr_auc": float(average_precision_score(y, s)), "roc_auc": float(roc_auc_score(y, s)), "n": int(len(y))}


def main():
    args = parse_args()
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(message)s",
    )
    torch.manual_seed(1234)

    os.makedirs(args.cache_dir, exist_ok=True)
    cache_path = os.path.join(args.cache_dir, "hetero_graph.pt")
    if os.path.exists(cache_path):
        data = torch.load(cache_path, weights_only=False)
    else:
        data = build_graph(args.data, args.val_start, args.test_start)
        torch.save(data, cache_path)
    log.info("graph: %s", data)

    tx = data["transaction"]
    train_idx = tx.train_mask.nonzero().view(-1)
    val_idx = tx.val_mask.nonzero().view(-1)
    test_idx = tx.test_mask.nonzero().view(-1)

    # identical permutation on every rank, then equal-size contiguous shards
    perm = torch.randperm(train_idx.numel(), generator=torch.Generator().manual_seed(0))
    per_rank = train_idx.numel() // world
    my_train = train_idx[perm][rank * per_rank:(rank + 1) * per_rank]

    n_pos = int(tx.y[train_idx].sum())
    pos_weight = (train_idx.numel() - n_pos) / max(n_pos, 1)
    log.info("train=%d val=%d test=%d fraud_rate=%.5f", train_idx.numel(), val_idx.numel(),
             test_idx.numel(), n_pos / train_idx.numel())

    train_loader = NeighborLoader(
        data,
        num_neighbors=args.fanout,
        input_nodes=("transaction", my_train),
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=args.num_workers,
        persistent_workers=args.num_workers > 0,
    )

    in_dims = {nt: data[nt].x.size(-1) for nt in data.node_types}
    model = HeteroSAGE(data.metadata(), in_dims, args.hidden, args.dropout).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wd)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    # soften the class weight, full neg/pos ratio makes precision collapse
    criterion = nn.BCEWithLogitsLoss(pos_weight=torch.tensor(pos_weight ** 0.5, device=device))

    os.makedirs(args.out, exist_ok=True)
    best, bad_epochs = -1.0, 0
    for epoch in range(args.epochs):
        model.train()
        t0, total, steps = time.time(), torch.zeros((), device=device), 0
        for batch in train_loader:
            batch = batch.to(device, non_blocking=True)
            bs = batch["transaction"].batch_size
            logits = model(batch.x_dict, batch.edge_index_dict)[:bs]
            loss = criterion(logits, batch["transaction"].y[:bs].float())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            total += loss.detach()
            steps += 1
        sched.step()
        dist.all_reduce(total)
        train_loss = total.item() / (steps * world)

        metrics = evaluate(model, data, val_idx, args, device, rank, world)
        log.info("epoch %d loss %.4f val %s (%.0fs)", epoch, train_loss, metrics, time.time() - t0)

        if metrics["pr_auc"] > best:
            best, bad_epochs = metrics["pr_auc"], 0
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "val": metrics},
                           os.path.join(args.out, "best.pt"))
        else:
            bad_epochs += 1
        dist.barrier()
        if bad_epochs >= args.patience:
            log.info("early stop at epoch %d", epoch)
            break

    ckpt = torch.load(os.path.join(args.out, "best.pt"), map_location=device)
    model.module.load_state_dict(ckpt["model"])
    test = evaluate(model, data, test_idx, args, device, rank, world)
    if rank == 0:
        log.info("test %s", test)
        with open(os.path.join(args.out, "test_metrics.json"), "w") as f:
            json.dump({"best_val_pr_auc": best, **test}, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
