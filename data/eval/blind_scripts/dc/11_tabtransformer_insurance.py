#!/usr/bin/env python
# TabTransformer for the motor-insurance claim table (claim / no claim).
# Categorical columns go through a transformer, numerical columns are layer-normed and concatenated.
#
#   torchrun --nproc_per_node=4 11_tabtransformer_insurance.py --train data/policies_train.csv \
#       --val data/policies_val.csv --epochs 30
import argparse
import json
import os
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
from torch.utils.data import DataLoader, Dataset, DistributedSampler

CAT_COLS = ["vehicle_make", "vehicle_model", "fuel", "region", "occupation", "payment_freq", "cover_type",
            "garage", "use_type", "bonus_malus_band"]
NUM_COLS = ["driver_age", "licence_years", "vehicle_age", "vehicle_power", "vehicle_value", "annual_km",
            "density", "premium", "prior_claims_3y"]
TARGET = "claim"


def parse_args():
    parser = argparse.ArgumentParser(description="TabTransformer DDP training")
    parser.add_argument("--train", required=True)
    parser.add_argument("--val", required=True)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=1024, help="global batch size")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default="checkpoints/tabtransformer")
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


class PolicyDataset(Dataset):
    def __init__(self, df, vocab, qt):
        self.cat = np.stack([df[c].astype(str).map(vocab[c]).fillna(0).astype(np.int64).values for c in CAT_COLS], 1)
        self.num = qt.transform(df[NUM_COLS].values).astype(np.float32)
        self.y = df[TARGET].values.astype(np.float32)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return torch.from_numpy(self.cat[i]), torch.from_numpy(self.num[i]), torch.tensor(self.y[i])


class TabTransformer(nn.Module):
    def __init__(self, cards, n_num, dim, depth, heads, mlp_mult=(4, 2)):
        super().__init__()
        offsets = np.concatenate([[0], np.cumsum(cards)[:-1]])
        self.register_buffer("offsets", torch.tensor(offsets, dtype=torch.long), persistent=False)
        self.emb = nn.Embedding(int(sum(cards)), dim)
        layer = nn.TransformerEncoderLayer(dim, heads, dim * 4, dropout=0.1, batch_first=True, activation="gelu")
        self.transformer = nn.TransformerEncoder(layer, depth)
        self.num_norm = nn.LayerNorm(n_num)
        d = dim * len(cards) + n_num
        self.mlp = nn.Sequential(nn.Linear(d, d * mlp_mult[0] // 4), nn.ReLU(), nn.Dropout(0.1),
                                 nn.Linear(d * mlp_mult[0] // 4, d * mlp_mult[1] // 4), nn.ReLU(),
                                 nn.Linear(d * mlp_mult[1] // 4, 1))

    def forward(self, x_cat, x_num):
        h = self.transformer(self.emb(x_cat + self.offsets))
        z = torch.cat([h.flatten(1), self.num_norm(x_num)], 1)
        return self.mlp(z).squeeze(-1)


def fit_preprocessing(train_df):
    vocab = {}
    for c in CAT_COLS:
        vals = train_df[c].astype(str).value_counts()
        vocab[c] = {v: i + 1 for i, v in enumerate(sorted(vals[vals >= 5].index))}
    qt = QuantileTransformer(n_quantiles=500, output_distribution="normal", random_state=0)
    qt.fit(train_df[NUM_COLS].values)
    return vocab, qt


@torch.no_grad()
def evaluate(model, val_ds, device, rank, world):
    model.eval()
    n = len(val_ds)
    idx = list(range(rank, n, world))
    scores = []
    for s in range(0, len(idx), 4096):
        b = idx[s:s + 4096]
        xc = torch.from_numpy(val_ds.cat[b]).to(device)
        xn = torch.from_numpy(val_ds.num[b]).to(device)
        scores.append(torch.sigmoid(model(xc, xn)).cpu().numpy())
    out = [None] * world
    dist.all_gather_object(out, (np.asarray(idx), np.concatenate(scores)))
    all_idx = np.concatenate([o[0] for o in out])
    all_scores = np.concatenate([o[1] for o in out])
    return roc_auc_score(val_ds.y[all_idx], all_scores)


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    torch.manual_seed(args.seed)

    train_df = pd.read_csv(args.train)
    val_df = pd.read_csv(args.val)
    for df in (train_df, val_df):
        df[NUM_COLS] = df[NUM_COLS].fillna(train_df[NUM_COLS].median())
    vocab, qt = fit_preprocessing(train_df)
    train_ds, val_ds = PolicyDataset(train_df, vocab, qt), PolicyDataset(val_df, vocab, qt)
    cards = [len(vocab[c]) + 1 for c in CAT_COLS]

    model = TabTransformer(cards, len(NUM_COLS), args.dim, args.depth, args.heads).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    loader = DataLoader(train_ds, batch_size=args.batch_size // world, sampler=sampler,
                        num_workers=4, pin_memory=True, drop_last=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0=10)

    # claims are rare (~7%), up-weight positives
    pos_frac = train_ds.y.mean()
    pos_weight = torch.tensor([(1 - pos_frac) / pos_frac], device=device)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "vocab.json"), "w") as f:
            json.dump(vocab, f)

    best_auc = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        start = time.time()
        total = torch.zeros(2, device=device)
        for i, (xc, xn, y) in enumerate(loader):
            xc, xn, y = xc.to(device, non_blocking=True), xn.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(xc, xn), y, pos_weight=pos_weight)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step(epoch + i / len(loader))
            total += torch.stack([loss.detach() * y.numel(), torch.tensor(float(y.numel()), device=device)])
        dist.all_reduce(total)

        auc = evaluate(model.module, val_ds, device, rank, world)
        if rank == 0:
            print(f"[epoch {epoch:02d}] train_loss={(total[0] / total[1]).item():.4f} val_auc={auc:.4f} "
                  f"time={time.time() - start:.1f}s", flush=True)
            if auc > best_auc:
                best_auc = auc
                torch.save(model.module.state_dict(), os.path.join(args.output_dir, "best.pt"))
        dist.barrier()

    if rank == 0:
        print(f"best val AUC: {best_auc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
