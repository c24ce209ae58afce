#!/usr/bin/env python
"""K-fold TabTransformer on the Adult census income data, trained with DDP.

Writes out-of-fold predictions (oof.csv), per-fold weights and the fold-averaged
test predictions (submission.csv) to --out-dir.

    torchrun --nproc_per_node=4 01_tabtransformer_adult_kfold.py \
        --train data/adult/train.csv --test data/adult/test.csv
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
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import StratifiedKFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

CAT_COLS = ["workclass", "education", "marital_status", "occupation",
            "relationship", "race", "sex", "native_country"]
NUM_COLS = ["age", "fnlwgt", "education_num", "capital_gain", "capital_loss", "hours_per_week"]
TARGET = "income"

logger = logging.getLogger("tabtr")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--test", required=True)
    p.add_argument("--out-dir", default="runs/tabtr_adult")
    p.add_argument("--n-folds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=256, help="per-GPU batch size")
    p.add_argument("--lr", type=float, default=1e-4, help="learning rate for a global batch of 256")
    p.add_argument("--weight-decay", type=float, default=1e-5)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


class TabDataset(Dataset):
    def __init__(self, x_cat, x_num, y):
        self.x_cat = torch.as_tensor(x_cat, dtype=torch.long)
        self.x_num = torch.as_tensor(x_num, dtype=torch.float32)
        self.y = torch.as_tensor(y, dtype=torch.float32)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return i, self.x_cat[i], self.x_num[i], self.y[i]


class TabTransformer(nn.Module):
    def __init__(self, cardinalities, n_num, dim=32, depth=6, heads=8, dropout=0.1, mlp_mult=(4, 2)):
        super().__init__()
        offsets = np.concatenate([[0], np.cumsum(cardinalities)[:-1]])
        self.register_buffer("offsets", torch.as_tensor(offsets, dtype=torch.long))
        self.embed = nn.Embedding(int(sum(cardinalities)), dim)
        layer = nn.TransformerEncoderLayer(dim, heads, dim * 4, dropout,
                                           activation="gelu", batch_first=True)
        self.transformer = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.num_norm = nn.LayerNorm(n_num)
        d_in = dim * len(cardinalities) + n_num
        layers, prev = [], d_in
        for m in mlp_mult:
            layers += [nn.Linear(prev, d_in * m // 4), nn.ReLU(), nn.Dropout(dropout)]
            prev = d_in * m // 4
        layers.append(nn.Linear(prev, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, x_cat, x_num):
        tok = self.transformer(self.embed(x_cat + self.offsets))
        h = torch.cat([tok.flatten(1), self.num_norm(x_num)], dim=1)
        return self.mlp(h).squeeze(-1)


def build_category_maps(frames):
    """Label-encode categoricals on train+test together; index 0 is kept for NaN."""
    full = pd.concat(frames, axis=0)
    maps = {}
    for c in CAT_COLS:
        values = full[c].dropna().astype(str).unique()
        maps[c] = {v: i + 1 for i, v in enumerate(sorted(values))}
    return maps


def encode(df, maps, mean, std):
    x_cat = np.stack([df[c].astype(str).map(maps[c]).fillna(0).astype(np.int64).values
                      for c in CAT_COLS], axis=1)
    x_num = ((df[NUM_COLS] - mean) / std).fillna(0.0).values.astype(np.float32)
    return x_cat, x_num


@torch.no_grad()
def predict(model, loader, device):
    model.eval()
    idx_all, out = [], []
    for idx, xc, xn, _ in loader:
        logits = model(xc.to(device, non_blocking=True), xn.to(device, non_blocking=True))
        out.append(torch.sigmoid(logits).float().cpu())
        idx_all.append(idx)
    return torch.cat(idx_all).numpy(), torch.cat(out).numpy()


def gather_predictions(idx, preds, n):
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (idx, preds))
    full = np.zeros(n, dtype=np.float32)
    for i, p in parts:
        full[i] = p  # samples padded by the sampler are written twice with the same value
    return full


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(args.seed)
    torch.backends.cudnn.benchmark = True

    train_df = pd.read_csv(args.train)
    test_df = pd.read_csv(args.test)
    train_df[TARGET] = (train_df[TARGET].str.strip().str.rstrip(".") == ">50K").astype(np.float32)
    maps = build_category_maps([train_df, test_df])
    cards = [len(maps[c]) + 1 for c in CAT_COLS]

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "config.json"), "w") as f:
            json.dump(vars(args), f, indent=2)
    dist.barrier()

    lr = args.lr * args.batch_size * world_size / 256
    skf = StratifiedKFold(n_splits=args.n_folds, shuffle=True)
    oof = np.zeros(len(train_df), dtype=np.float32)
    test_pred = np.zeros(len(test_df), dtype=np.float32)
    fold_scores = []

    for fold, (tr_idx, va_idx) in enumerate(skf.split(train_df, train_df[TARGET])):
        tr, va = train_df.iloc[tr_idx], train_df.iloc[va_idx]
        mean, std = tr[NUM_COLS].mean(), tr[NUM_COLS].std() + 1e-6
        train_ds = TabDataset(*encode(tr, maps, mean, std), tr[TARGET].values)
        val_ds = TabDataset(*encode(va, maps, mean, std), va[TARGET].values)
        test_ds = TabDataset(*encode(test_df, maps, mean, std), np.zeros(len(test_df)))

        train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
        train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                                  num_workers=args.workers, pin_memory=True, drop_last=True,
                                  persistent_workers=args.workers > 0)
        val_loader = DataLoader(val_ds, batch_size=1024, num_workers=2,
                                sampler=DistributedSampler(val_ds, shuffle=False))
        test_loader = DataLoader(test_ds, batch_size=1024, num_workers=2,
                                 sampler=DistributedSampler(test_ds, shuffle=False))

        model = TabTransformer(cards, len(NUM_COLS), args.dim, args.depth, args.heads, args.dropout).to(device)
        model = DDP(model, device_ids=[local_rank], output_device=local_rank)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.weight_decay)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_loader))

        best_auc, best_state, best_epoch = -1.0, None, -1
        for epoch in range(args.epochs):
            train_sampler.set_epoch(epoch)
            model.train()
            t0, running = time.time(), torch.zeros(2, device=device)
            for _, xc, xn, y in train_loader:
                xc, xn, y = xc.to(device, non_blocking=True), xn.to(device, non_blocking=True), y.to(device, non_blocking=True)
                loss = F.binary_cross_entropy_with_logits(model(xc, xn), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                scheduler.step()
                running += torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)), device=device)])
            dist.all_reduce(running)

            idx, p = predict(model.module, val_loader, device)
            val_pred = gather_predictions(idx, p, len(val_ds))
            auc = roc_auc_score(va[TARGET].values, val_pred)
            logger.info("fold %d epoch %d loss %.4f val_auc %.5f (%.1fs)", fold, epoch,
                        (running[0] / running[1]).item(), auc, time.time() - t0)
            if auc > best_auc:
                best_auc, best_epoch = auc, epoch
                best_state = {k: v.detach().cpu().clone() for k, v in model.module.state_dict().items()}
                oof[va_idx] = val_pred

        model.module.load_state_dict(best_state)
        idx, p = predict(model.module, test_loader, device)
        test_pred += gather_predictions(idx, p, len(test_ds)) / args.n_folds
        fold_scores.append(best_auc)
        logger.info("fold %d best auc %.5f at epoch %d", fold, best_auc, best_epoch)

        if rank == 0:
            torch.save(best_state, os.path.join(args.out_dir, f"tabtr_fold{fold}.pt"))
        dist.barrier()
        del model, optimizer

    if rank == 0:
        cv = roc_auc_score(train_df[TARGET].values, oof)
        logger.info("fold aucs %s | mean %.5f | oof auc %.5f", np.round(fold_scores, 5), np.mean(fold_scores), cv)
        pd.DataFrame({"id": np.arange(len(train_df)), "oof": oof, TARGET: train_df[TARGET]}).to_csv(
            os.path.join(args.out_dir, "oof.csv"), index=False)
        pd.DataFrame({"id": np.arange(len(test_df)), TARGET: test_pred}).to_csv(
            os.path.join(args.out_dir, "submission.csv"), index=False)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
