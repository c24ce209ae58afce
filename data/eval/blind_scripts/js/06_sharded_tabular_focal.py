#!/usr/bin/env python3
"""Tabular fraud MLP (entity embeddings + numeric features) with focal loss.

Training data is the daily export: hundreds of parquet part files, each rank reads
its own subset of files. The focal-loss alpha is set from the global fraud rate.

Launch (2 nodes x 8 GPUs):
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        06_sharded_tabular_focal.py --train-glob '/lake/fraud/train/part-*.parquet'
"""
import argparse
import glob
import json
import os
import time

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import average_precision_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

CAT_FEATURES = {"mcc": 1024, "merchant_country": 256, "pos_entry": 16, "card_brand": 8, "channel": 8}
NUM_FEATURES = ["amt_log", "amt_z_card_30d", "n_txn_card_1h", "n_txn_card_24h", "secs_since_last",
                "dist_prev_km", "merchant_fraud_rate_90d", "card_age_days", "is_foreign", "hour_sin",
                "hour_cos"]


def read_files(files):
    tables = [pq.read_table(f, columns=NUM_FEATURES + list(CAT_FEATURES) + ["label"]) for f in files]
    num = np.concatenate([np.stack([t[c].to_numpy() for c in NUM_FEATURES], 1) for t in tables]).astype(np.float32)
    cat = np.concatenate([np.stack([t[c].to_numpy() for c in CAT_FEATURES], 1) for t in tables]).astype(np.int64)
    y = np.concatenate([t["label"].to_numpy() for t in tables]).astype(np.float32)
    for j, (name, card) in enumerate(CAT_FEATURES.items()):
        cat[:, j] = np.clip(cat[:, j], 0, card - 1)  # hashed upstream, 0 = unknown
    return np.nan_to_num(num), cat, y


class FraudMLP(nn.Module):
    def __init__(self, n_num, cat_cards, emb_dim=12, hidden=(512, 256, 128), dropout=0.15):
        super().__init__()
        self.embs = nn.ModuleList(nn.Embedding(c, emb_dim) for c in cat_cards)
        d = n_num + emb_dim * len(cat_cards)
        blocks = []
        for h in hidden:
            blocks += [nn.Linear(d, h), nn.LayerNorm(h), nn.SiLU(), nn.Dropout(dropout)]
            d = h
        self.mlp = nn.Sequential(*blocks)
        self.out = nn.Linear(d, 1)

    def forward(self, num, cat):
        e = torch.cat([m(cat[:, j]) for j, m in enumerate(self.embs)], dim=1)
        return self.out(self.mlp(torch.cat([num, e], dim=1))).squeeze(1)


def focal_loss(logits, y, alpha, gamma=2.0):
    p = torch.sigmoid(logits)
    ce = F.binary_cross_entropy_with_logits(logits, y, reduction="none")
    p_t = p * y + (1 - p) * (1 - y)
    a_t = alpha * y + (1 - alpha) * (1 - y)
    return (a_t * (1 - p_t) ** gamma * ce).mean()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-glob", required=True)
    ap.add_argument("--val-glob", default="/lake/fraud/val/part-*.parquet")
    ap.add_argument("--out", default="/shared/models/fraud_mlp")
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--gamma", type=float, default=2.0)
    args = ap.parse_args()

    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(42)

    train_files = sorted(glob.glob(args.train_glob))
    val_files = sorted(glob.glob(args.val_glob))
    my_train, my_val = train_files[rank::world], val_files[rank::world]
    num, cat, y = read_files(my_train)
    vnum, vcat, vy = read_files(my_val)

    # global fraud prior -> focal alpha
    counts = torch.tensor([y.sum(), float(len(y))], dtype=torch.float64)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    fraud_rate = (counts[0] / counts[1]).item()
    alpha = float(np.clip(1.0 - fraud_rate, 0.75, 0.99))

    # normalisation stats from this rank's shard are close enough; files are random partitions
    mu, sd = num.mean(0), num.std(0) + 1e-6
    stats = torch.tensor(np.stack([mu, sd]), device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.AVG)
    mu, sd = stats[0].cpu().numpy(), stats[1].cpu().numpy()
    num, vnum = (num - mu) / sd, (vnum - mu) / sd

    train_ds = TensorDataset(torch.from_numpy(num), torch.from_numpy(cat), torch.from_numpy(y))
    loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        num_workers=2, pin_memory=True)
    # part files differ slightly in row count, so every rank runs the same (minimum) number of steps
    n_steps = torch.tensor(len(loader), device=device)
    dist.all_reduce(n_steps, op=dist.ReduceOp.MIN)
    n_steps = int(n_steps.item())

    model = DDP(FraudMLP(len(NUM_FEATURES), list(CAT_FEATURES.values())).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * n_steps)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world={world} files/rank~{len(my_train)} fraud_rate={fraud_rate:.5f} alpha={alpha:.3f} "
              f"steps/epoch={n_steps}", flush=True)

    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        it = iter(loader)
        for step in range(n_steps):
            bn, bc, by = (t.to(device, non_blocking=True) for t in next(it))
            loss = focal_loss(model(bn, bc), by, alpha, args.gamma)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if step % 200 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} step {step}/{n_steps} loss {l.item():.5f}", flush=True)

        model.eval()
        with torch.no_grad():
            preds = []
            for i in range(0, len(vy), 16384):
                bn = torch.from_numpy(vnum[i:i + 16384]).to(device)
                bc = torch.from_numpy(vcat[i:i + 16384]).to(device)
                preds.append(torch.sigmoid(model.module(bn, bc)).cpu().numpy())
            local = (np.concatenate(preds) if preds else np.zeros(0, np.float32), vy)
        gathered = [None] * world
        dist.all_gather_object(gathered, local)
        if rank == 0:
            p = np.concatenate([g[0] for g in gathered])
            t = np.concatenate([g[1] for g in gathered])
            ap_score = average_precision_score(t, p)
            print(f"epoch {epoch} val PR-AUC {ap_score:.4f} n={len(t)} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.module.state_dict(), "mu": mu, "sd": sd, "alpha": alpha, "epoch": epoch},
                       os.path.join(args.out, f"epoch{epoch}.pt"))
            with open(os.path.join(args.out, "metrics.jsonl"), "a") as f:
                f.write(json.dumps({"epoch": epoch, "val_pr_auc": ap_score}) + "\n")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
