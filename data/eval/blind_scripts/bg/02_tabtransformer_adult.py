#!/usr/bin/env python
# TabTransformer (Huang et al. 2020) on the UCI Adult census income data.
# Categorical columns go through a transformer encoder, continuous columns are
# layer-normed and concatenated before the MLP head.
#
# usage: torchrun --nproc_per_node=4 02_tabtransformer_adult.py --csv data/adult.csv
import argparse
import csv
import logging
import os
import random

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import train_test_split
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

CAT_COLS = ["workclass", "education", "marital_status", "occupation", "relationship",
            "race", "sex", "native_country"]
NUM_COLS = ["age", "fnlwgt", "education_num", "capital_gain", "capital_loss", "hours_per_week"]
TARGET = "income"

log = logging.getLogger("tabtransformer")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default="data/adult.csv")
    ap.add_argument("--output", default="outputs/tabtransformer_adult")
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--attn-dropout", type=float, default=0.1)
    ap.add_argument("--ff-dropout", type=float, default=0.1)
    ap.add_argument("--batch-size", type=int, default=256, help="per GPU")
    ap.add_argument("--base-lr", type=float, default=1e-4, help="lr for a 256 global batch")
    ap.add_argument("--weight-decay", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--patience", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class TabTransformer(nn.Module):
    def __init__(self, cardinalities, n_num, dim, depth, heads, attn_dropout, ff_dropout):
        super().__init__()
        # one shared table with per-column offsets, +1 slot per column for unseen values
        offsets = np.cumsum([0] + [c + 1 for c in cardinalities[:-1]])
        self.register_buffer("offsets", torch.tensor(offsets, dtype=torch.long), persistent=False)
        self.embed = nn.Embedding(sum(c + 1 for c in cardinalities), dim)
        self.col_embed = nn.Parameter(torch.randn(len(cardinalities), dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=4 * dim, dropout=attn_dropout,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.transformer = nn.TransformerEncoder(layer, depth)
        self.num_norm = nn.LayerNorm(n_num)
        d_in = dim * len(cardinalities) + n_num
        h1, h2 = d_in // 2, d_in // 4
        self.mlp = nn.Sequential(
            nn.Linear(d_in, h1), nn.ReLU(), nn.Dropout(ff_dropout),
            nn.Linear(h1, h2), nn.ReLU(), nn.Dropout(ff_dropout),
            nn.Linear(h2, 1),
        )

    def forward(self, x_cat, x_num):
        tok = self.embed(x_cat + self.offsets) + self.col_embed
        ctx = self.transformer(tok).flatten(1)
        return self.mlp(torch.cat([ctx, self.num_norm(x_num)], dim=1)).squeeze(-1)


def encode(df, vocabs, mean, std):
    cats = np.stack([df[c].map(vocabs[c]).fillna(len(vocabs[c])).astype(np.int64).to_numpy()
                     for c in CAT_COLS], axis=1)
    nums = ((df[NUM_COLS].to_numpy(np.float32) - mean) / std).astype(np.float32)
    y = (df[TARGET].str.strip().str.rstrip(".") == ">50K").to_numpy(np.float32)
    return TensorDataset(torch.from_numpy(cats), torch.from_numpy(nums), torch.from_numpy(y))


def prepare_data(path, seed):
    df = pd.read_csv(path, skipinitialspace=True, na_values="?")
    for c in CAT_COLS:
        df[c] = df[c].fillna("missing").astype(str)
    df[NUM_COLS] = df[NUM_COLS].astype(np.float32)
    df["capital_gain"] = np.log1p(df["capital_gain"])
    df["capital_loss"] = np.log1p(df["capital_loss"])

    train_df, rest = train_test_split(df, test_size=0.3, stratify=df[TARGET])
    val_df, test_df = train_test_split(rest, test_size=0.5, stratify=rest[TARGET])

    vocabs = {c: {v: i for i, v in enumerate(sorted(train_df[c].unique()))} for c in CAT_COLS}
    mean = train_df[NUM_COLS].to_numpy(np.float32).mean(0)
    std = train_df[NUM_COLS].to_numpy(np.float32).std(0) + 1e-6
    return (encode(train_df, vocabs, mean, std), encode(val_df, vocabs, mean, std),
            encode(test_df, vocabs, mean, std), [len(vocabs[c]) for c in CAT_COLS])


@torch.no_grad()
def predict(model, loader, device):
    model.eval()
    probs, labels = [], []
    for x_cat, x_num, y in loader:
        logits = model(x_cat.to(device), x_num.to(device))
        probs.append(torch.sigmoid(logits).cpu())
        labels.append(y)
    model.train()
    return torch.cat(probs).numpy(), torch.cat(labels).numpy()


def gather_predictions(probs, labels, world):
    out = [None] * world
    dist.all_gather_object(out, (probs, labels))
    p = np.concatenate([o[0] for o in out])
    y = np.concatenate([o[1] for o in out])
    return p, y


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(asctime)s %(message)s")

    # different dropout masks on each rank
    set_seed(args.seed + rank)

    train_ds, val_ds, test_ds, cards = prepare_data(args.csv, args.seed)
    log.info("train %d / val %d / test %d rows, cardinalities %s", len(train_ds), len(val_ds),
             len(test_ds), cards)

    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                              num_workers=2, pin_memory=True, drop_last=True)
    # evaluation shards without padding so every row is scored once
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)),
                            batch_size=1024)
    test_loader = DataLoader(torch.utils.data.Subset(test_ds, range(rank, len(test_ds), world)),
                             batch_size=1024)

    model = TabTransformer(cards, len(NUM_COLS), args.dim, args.depth, args.heads,
                           args.attn_dropout, args.ff_dropout).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.base_lr * args.batch_size * world / 256
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.weight_decay)
    loss_fn = nn.BCEWithLogitsLoss()

    os.makedirs(args.output, exist_ok=True)
    ckpt_path = os.path.join(args.output, "best.pt")
    best_auc, stale = -1.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total = torch.zeros(2, device=device)
        for x_cat, x_num, y in train_loader:
            x_cat, x_num, y = x_cat.to(device), x_num.to(device), y.to(device)
            loss = loss_fn(model(x_cat, x_num), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total[0] += loss.detach() * len(y)
            total[1] += len(y)
        dist.all_reduce(total)

        p, yv = gather_predictions(*predict(model.module, val_loader, device), world)
        val_auc = roc_auc_score(yv, p)
        log.info("epoch %d  train_loss %.4f  val_auc %.4f", epoch, (total[0] / total[1]).item(), val_auc)

        if val_auc > best_auc:
            best_auc, stale = val_auc, 0
            if rank == 0:
                torch.save(model.module.state_dict(), ckpt_path)
        else:
            stale += 1
        if stale >= args.patience:
            log.info("no improvement for %d epochs, stopping", args.patience)
            break

    dist.barrier()
    model.module.load_state_dict(torch.load(ckpt_path, map_location=device))
    p, yt = gather_predictions(*predict(model.module, test_loader, device), world)
    if rank == 0:
        test_auc = roc_auc_score(yt, p)
        acc = ((p > 0.5) == (yt > 0.5)).mean()
        log.info("test auc %.4f acc %.4f", test_auc, acc)
        with open(os.path.join(args.output, "metrics.csv"), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["split", "auc", "accuracy"])
            w.writerow(["val_best", f"{best_auc:.5f}", ""])
            w.writerow(["test", f"{test_auc:.5f}", f"{acc:.5f}"])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
