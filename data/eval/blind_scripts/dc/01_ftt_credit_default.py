#!/usr/bin/env python
"""FT-Transformer baseline for the credit-default table.

    torchrun --nproc_per_node=4 01_ftt_credit_default.py \
        --data /datasets/credit/train.parquet --target default_90d --out runs/ftt_credit
"""
import argparse
import json
import logging
import math
import os
import random
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from sklearn.preprocessing import QuantileTransformer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

logger = logging.getLogger("ftt")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--target", default="default_90d")
    p.add_argument("--id-col", default="customer_id")
    p.add_argument("--val-frac", type=float, default=0.1)
    p.add_argument("--max-card", type=int, default=5000)
    p.add_argument("--d-token", type=int, default=192)
    p.add_argument("--n-blocks", type=int, default=3)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--dropout", type=float, default=0.15)
    p.add_argument("--batch-size", type=int, default=2048, help="global batch, split over GPUs")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=1e-5)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--out", default="runs/ftt")
    return p.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class TabularDataset(Dataset):
    def __init__(self, x_num, x_cat, y):
        self.x_num = torch.as_tensor(x_num, dtype=torch.float32)
        self.x_cat = torch.as_tensor(x_cat, dtype=torch.long)
        self.y = torch.as_tensor(y, dtype=torch.float32)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x_num[i], self.x_cat[i], self.y[i]


class FeatureTokenizer(nn.Module):
    def __init__(self, n_num, cardinalities, d_token):
        super().__init__()
        self.num_weight = nn.Parameter(torch.empty(n_num, d_token))
        self.num_bias = nn.Parameter(torch.empty(n_num, d_token))
        for w in (self.num_weight, self.num_bias):
            nn.init.kaiming_uniform_(w, a=math.sqrt(5))
        # index 0 is reserved for unseen / rare categories
        self.cat_emb = nn.ModuleList(nn.Embedding(c + 1, d_token) for c in cardinalities)
        self.cls = nn.Parameter(torch.zeros(1, 1, d_token))
        nn.init.normal_(self.cls, std=0.02)

    def forward(self, x_num, x_cat):
        tokens = [x_num.unsqueeze(-1) * self.num_weight + self.num_bias]
        if len(self.cat_emb):
            tokens.append(torch.stack([emb(x_cat[:, i]) for i, emb in enumerate(self.cat_emb)], dim=1))
        x = torch.cat(tokens, dim=1)
        return torch.cat([self.cls.expand(x.size(0), -1, -1), x], dim=1)


class FTTransformer(nn.Module):
    def __init__(self, n_num, cardinalities, d_token, n_blocks, n_heads, dropout):
        super().__init__()
        self.tokenizer = FeatureTokenizer(n_num, cardinalities, d_token)
        layer = nn.TransformerEncoderLayer(
            d_token, n_heads, dim_feedforward=int(d_token * 4 / 3), dropout=dropout,
            activation="gelu", batch_first=True, norm_first=True,
        )
        self.encoder = nn.TransformerEncoder(layer, n_blocks, enable_nested_tensor=False)
        self.head = nn.Sequential(nn.LayerNorm(d_token), nn.ReLU(), nn.Linear(d_token, 1))

    def forward(self, x_num, x_cat):
        h = self.encoder(self.tokenizer(x_num, x_cat))
        return self.head(h[:, 0]).squeeze(-1)


def encode_categoricals(train_df, frames, cat_cols, max_card):
    """Map every categorical column to 1..K, 0 = unknown. Vocab comes from the train split."""
    cards = []
    for c in cat_cols:
        counts = train_df[c].astype(str).value_counts()
        vocab = sorted(counts.index[:max_card])
        mapping = {v: i + 1 for i, v in enumerate(vocab)}
        cards.append(max_card)
        for f in frames:
            f[c] = f[c].astype(str).map(mapping).fillna(0).astype(np.int64)
    return cards


def load_data(args):
    df = pd.read_parquet(args.data)
    df = df.drop(columns=[args.id_col], errors="ignore")
    y = df.pop(args.target).astype(np.float32).values
    cat_cols = [c for c in df.columns if df[c].dtype == object or str(df[c].dtype) == "category"]
    num_cols = [c for c in df.columns if c not in cat_cols]

    perm = np.random.permutation(len(df))
    n_val = int(len(df) * args.val_frac)
    val_idx, train_idx = perm[:n_val], perm[n_val:]
    train_df, val_df = df.iloc[train_idx].copy(), df.iloc[val_idx].copy()

    cards = encode_categoricals(train_df, [train_df, val_df], cat_cols, args.max_card)

    qt = QuantileTransformer(n_quantiles=1000, output_distribution="normal",
                             subsample=200_000, random_state=args.seed)
    med = train_df[num_cols].median()
    x_num_tr = qt.fit_transform(train_df[num_cols].fillna(med).values)
    x_num_va = qt.transform(val_df[num_cols].fillna(med).values)

    train_ds = TabularDataset(x_num_tr, train_df[cat_cols].values, y[train_idx])
    val_ds = TabularDataset(x_num_va, val_df[cat_cols].values, y[val_idx])
    return train_ds, val_ds, len(num_cols), cards


@torch.no_grad()
def evaluate(model, val_ds, rank, world_size, batch_size, device):
    idx = np.arange(len(val_ds))[rank::world_size]
    loader = DataLoader(Subset(val_ds, idx), batch_size=batch_size * 4, shuffle=False, num_workers=2)
    model.eval()
    preds, labels = [], []
    for x_num, x_cat, y in loader:
        logits = model(x_num.to(device, non_blocking=True), x_cat.to(device, non_blocking=True))
        preds.append(torch.sigmoid(logits).float().cpu())
        labels.append(y)
    local = (torch.cat(preds).numpy(), torch.cat(labels).numpy())
    gathered = [None] * world_size
    dist.all_gather_object(gathered, local)
    p = np.concatenate([g[0] for g in gathered])
    t = np.concatenate([g[1] for g in gathered])
    return roc_auc_score(t, p), float(F.binary_cross_entropy(torch.from_numpy(p).clamp(1e-7, 1 - 1e-7),
                                                           torch.from_numpy(t)))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    # different dropout masks per rank
    seed_everything(args.seed + rank)

    train_ds, val_ds, n_num, cards = load_data(args)
    logger.info("train=%d val=%d num=%d cat=%d", len(train_ds), len(val_ds), n_num, len(cards))

    model = FTTransformer(n_num, cards, args.d_token, args.n_blocks, args.n_heads, args.dropout).to(device)
    model = DDP(model, device_ids=[local_rank])

    per_gpu_bs = args.batch_size // world_size
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=per_gpu_bs, sampler=sampler,
                        num_workers=4, pin_memory=True, drop_last=True, persistent_workers=True)

    no_decay = [p for n, p in model.named_parameters() if "bias" in n or "norm" in n or "cls" in n]
    decay = [p for n, p in model.named_parameters() if not ("bias" in n or "norm" in n or "cls" in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr)

    pos_rate = float(train_ds.y.mean())
    pos_weight = torch.tensor((1 - pos_rate) / max(pos_rate, 1e-6), device=device)

    os.makedirs(args.out, exist_ok=True)
    best_auc, history = -1.0, []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, run_loss, n = time.time(), 0.0, 0
        for x_num, x_cat, y in loader:
            x_num, x_cat, y = x_num.to(device, non_blocking=True), x_cat.to(device, non_blocking=True), y.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x_num, x_cat)
            loss = F.binary_cross_entropy_with_logits(logits.float(), y, pos_weight=pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            run_loss += loss.item()
            n += 1

        auc, logloss = evaluate(model.module, val_ds, rank, world_size, per_gpu_bs, device)
        if rank == 0:
            history.append({"epoch": epoch, "train_loss": run_loss / max(n, 1), "val_auc": auc,
                            "val_logloss": logloss, "sec": time.time() - t0})
            logger.info(json.dumps(history[-1]))
            if auc > best_auc:
                best_auc = auc
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "auc": auc,
                            "args": vars(args)}, os.path.join(args.out, "best.pt"))
        dist.barrier()

    if rank == 0:
        with open(os.path.join(args.out, "history.json"), "w") as f:
            json.dump(history, f, indent=2)
        logger.info("best val AUC %.5f", best_auc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
