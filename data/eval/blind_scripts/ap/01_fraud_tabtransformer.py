#!/usr/bin/env python
"""Card-fraud scoring with a TabTransformer, trained on several GPUs with torchrun.

Time-based split: everything before --valid-start is training, the rest is validation.
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
from sklearn.metrics import average_precision_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, WeightedRandomSampler
from torch.utils.data.distributed import DistributedSampler

CAT_COLS = ["merchant_category", "card_type", "country", "channel", "device_type", "hour_bucket"]
NUM_COLS = ["amount", "amount_log", "txn_count_24h", "avg_amount_7d", "days_since_last", "distance_home_km"]
TARGET = "is_fraud"

logger = logging.getLogger("fraud")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/fraud/transactions.parquet")
    p.add_argument("--valid-start", default="2024-01-01")
    p.add_argument("--out-dir", default="runs/fraud_tabtransformer")
    p.add_argument("--global-batch-size", type=int, default=4096)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=1e-5)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--patience", type=int, default=4)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=17)
    return p.parse_args()


def setup_ddp():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return dist.get_rank(), local_rank, dist.get_world_size()


def build_vocabs(df):
    # 0 is reserved for categories never seen in training
    return {c: {v: i + 1 for i, v in enumerate(sorted(df[c].astype(str).unique()))} for c in CAT_COLS}


def encode(df, vocabs, num_mean, num_std):
    x_cat = np.stack([df[c].astype(str).map(vocabs[c]).fillna(0).astype(np.int64).values for c in CAT_COLS], 1)
    x_num = ((df[NUM_COLS].values - num_mean) / num_std).astype(np.float32)
    y = df[TARGET].values.astype(np.float32)
    return x_cat, np.nan_to_num(x_num), y


class TxnDataset(Dataset):
    def __init__(self, x_cat, x_num, y):
        self.x_cat = torch.from_numpy(x_cat)
        self.x_num = torch.from_numpy(x_num)
        self.y = torch.from_numpy(y)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return i, self.x_cat[i], self.x_num[i], self.y[i]


class TabTransformer(nn.Module):
    def __init__(self, cardinalities, n_num, d_model=32, n_heads=4, n_layers=4, mlp_hidden=(256, 128), dropout=0.1):
        super().__init__()
        self.embeds = nn.ModuleList([nn.Embedding(c + 1, d_model) for c in cardinalities])
        self.col_embed = nn.Parameter(torch.randn(len(cardinalities), d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, dim_feedforward=4 * d_model,
                                           dropout=dropout, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layers)
        self.num_norm = nn.LayerNorm(n_num)
        in_dim = d_model * len(cardinalities) + n_num
        blocks = []
        for h in mlp_hidden:
            blocks += [nn.Linear(in_dim, h), nn.GELU(), nn.Dropout(dropout)]
            in_dim = h
        blocks.append(nn.Linear(in_dim, 1))
        self.head = nn.Sequential(*blocks)

    def forward(self, x_cat, x_num):
        tok = torch.stack([emb(x_cat[:, i]) for i, emb in enumerate(self.embeds)], dim=1)
        tok = self.encoder(tok + self.col_embed)
        h = torch.cat([tok.flatten(1), self.num_norm(x_num)], dim=1)
        return self.head(h).squeeze(-1)


@torch.no_grad()
def predict(model, loader, device):
    model.eval()
    idx_out, prob_out = [], []
    for idx, x_cat, x_num, _ in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x_cat.to(device, non_blocking=True), x_num.to(device, non_blocking=True))
        prob_out.append(torch.sigmoid(logits.float()).cpu().numpy())
        idx_out.append(idx.numpy())
    return np.concatenate(idx_out), np.concatenate(prob_out)


def gather_predictions(idx, prob, world_size):
    parts = [None] * world_size
    dist.all_gather_object(parts, (idx, prob))
    idx = np.concatenate([p[0] for p in parts])
    prob = np.concatenate([p[1] for p in parts])
    # DistributedSampler pads the last shard with repeated rows
    idx, first = np.unique(idx, return_index=True)
    return idx, prob[first]


def main():
    args = parse_args()
    rank, local_rank, world_size = setup_ddp()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    df = pd.read_parquet(args.data)
    df["event_time"] = pd.to_datetime(df["event_time"])
    train_df = df[df["event_time"] < args.valid_start].reset_index(drop=True)
    valid_df = df[df["event_time"] >= args.valid_start].reset_index(drop=True)
    logger.info("train %d rows (%.3f%% fraud), valid %d rows", len(train_df),
                100 * train_df[TARGET].mean(), len(valid_df))

    vocabs = build_vocabs(train_df)
    num_mean = train_df[NUM_COLS].mean().values
    num_std = train_df[NUM_COLS].std().values + 1e-6
    train_ds = TxnDataset(*encode(train_df, vocabs, num_mean, num_std))
    valid_ds = TxnDataset(*encode(valid_df, vocabs, num_mean, num_std))
    y_valid = valid_ds.y.numpy()

    per_gpu_bs = args.global_batch_size // world_size
    y_train = train_ds.y.numpy()
    pos, neg = y_train.sum(), len(y_train) - y_train.sum()
    sample_weights = np.where(y_train == 1, 0.5 / pos, 0.5 / neg)
    train_sampler = WeightedRandomSampler(torch.as_tensor(sample_weights, dtype=torch.double),
                                          num_samples=len(sample_weights), replacement=True)
    train_loader = DataLoader(train_ds, batch_size=per_gpu_bs, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    valid_sampler = DistributedSampler(valid_ds, shuffle=False)
    valid_loader = DataLoader(valid_ds, batch_size=2 * per_gpu_bs, sampler=valid_sampler,
                              num_workers=args.workers, pin_memory=True)

    model = TabTransformer([len(vocabs[c]) for c in CAT_COLS], len(NUM_COLS),
                           d_model=args.d_model, n_layers=args.layers).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_loader))

    os.makedirs(args.out_dir, exist_ok=True)
    best_path = os.path.join(args.out_dir, "best.pt")
    best_auc, bad_epochs = -1.0, 0
    history = []

    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        loss_acc = torch.zeros(2, device=device)
        for _, x_cat, x_num, y in train_loader:
            x_cat = x_cat.to(device, non_blocking=True)
            x_num = x_num.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x_cat, x_num)
            loss = F.binary_cross_entropy_with_logits(logits.float(), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            loss_acc[0] += loss.detach() * y.size(0)
            loss_acc[1] += y.size(0)
        dist.all_reduce(loss_acc)
        train_loss = (loss_acc[0] / loss_acc[1]).item()

        idx, prob = predict(model, valid_loader, device)
        idx, prob = gather_predictions(idx, prob, world_size)

        stop = torch.zeros(1, device=device)
        if rank == 0:
            auc = roc_auc_score(y_valid[idx], prob)
            ap = average_precision_score(y_valid[idx], prob)
            history.append({"epoch": epoch, "train_loss": train_loss, "auc": auc, "ap": ap})
            logger.info("epoch %d loss %.4f val_auc %.4f val_ap %.4f (%.0fs)",
                        epoch, train_loss, auc, ap, time.time() - t0)
            if auc > best_auc:
                best_auc, bad_epochs = auc, 0
                torch.save({"model": model.module.state_dict(), "vocabs": vocabs,
                            "num_mean": num_mean, "num_std": num_std, "epoch": epoch}, best_path)
            else:
                bad_epochs += 1
                if bad_epochs >= args.patience:
                    stop.fill_(1)
        dist.broadcast(stop, src=0)
        if stop.item() > 0:
            logger.info("early stopping at epoch %d, best auc %.4f", epoch, best_auc)
            break

    if rank == 0:
        with open(os.path.join(args.out_dir, "history.json"), "w") as f:
            json.dump(history, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
