#!/usr/bin/env python
"""
Used-car price regression (Playground S4E9 style data).

Stage "train": k-fold FT-Transformer with DDP, per-fold target encoding of the
high-cardinality columns (brand/model/engine), OOF RMSE, one checkpoint per fold.
Stage "predict": load every fold checkpoint into a fresh model and average test predictions.

    torchrun --nproc_per_node=4 16_used_car_price_kfold_ensemble.py --stage all \
        --train data/cars/train.csv --test data/cars/test.csv --out runs/cars_ftt
"""
import argparse
import os
import pickle

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.model_selection import KFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

LOW_CARD = ["fuel_type", "transmission", "ext_col", "int_col", "accident", "clean_title"]
HIGH_CARD = ["brand", "model", "engine"]
NUMERIC = ["milage", "model_year"]


class FTTransformer(nn.Module):
    def __init__(self, n_num, cards, d=128, depth=3, heads=8, drop=0.1):
        super().__init__()
        self.num_w = nn.Parameter(torch.randn(n_num, d) / d ** 0.5)
        self.num_b = nn.Parameter(torch.zeros(n_num, d))
        self.cat = nn.ModuleList(nn.Embedding(c, d) for c in cards)
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        layer = nn.TransformerEncoderLayer(d, heads, 2 * d, drop, activation="gelu", batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = nn.Sequential(nn.LayerNorm(d), nn.ReLU(), nn.Linear(d, 1))

    def forward(self, x_num, x_cat):
        t = torch.cat([self.cls.expand(len(x_num), -1, -1),
                       x_num.unsqueeze(-1) * self.num_w + self.num_b,
                       torch.stack([e(x_cat[:, i]) for i, e in enumerate(self.cat)], 1)], 1)
        return self.head(self.encoder(t)[:, 0]).squeeze(-1)


def low_card_codes(train, test):
    cards = []
    for c in LOW_CARD:
        vc = train[c].fillna("NA").value_counts()
        keep = sorted(vc[vc >= 20].index)
        lut = {v: i + 1 for i, v in enumerate(keep)}
        train[c] = train[c].fillna("NA").map(lut).fillna(0).astype(np.int64)
        test[c] = test[c].fillna("NA").map(lut).fillna(0).astype(np.int64)
        cards.append(len(keep) + 1)
    return cards


def te_fit(keys, y, alpha=20.0):
    prior = float(y.mean())
    g = pd.DataFrame({"k": keys, "y": y}).groupby("k")["y"].agg(["sum", "count"])
    return ((g["sum"] + alpha * prior) / (g["count"] + alpha)).to_dict(), prior


def fold_numeric(train, test, tr_idx, va_idx, y_log, seed):
    """Numeric block for one fold: raw numerics + target encodings (OOF inside the train part)."""
    tr = train.iloc[tr_idx]
    cols_tr, cols_va, cols_te, enc = [], [], [], {}
    for c in HIGH_CARD:
        inner = np.zeros(len(tr_idx), np.float32)
        for a, b in KFold(5, shuffle=True, random_state=seed).split(tr_idx):
            m, prior = te_fit(tr[c].values[a], y_log[tr_idx][a])
            inner[b] = pd.Series(tr[c].values[b]).map(m).fillna(prior).values
        m, prior = te_fit(tr[c].values, y_log[tr_idx])
        enc[c] = (m, prior)
        cols_tr.append(inner)
        cols_va.append(train[c].iloc[va_idx].map(m).fillna(prior).values)
        cols_te.append(test[c].map(m).fillna(prior).values)
    base = lambda f: np.column_stack([np.log1p(f["milage"].values), f["model_year"].values - 2000])
    x_tr = np.column_stack([base(tr)] + cols_tr).astype(np.float32)
    x_va = np.column_stack([base(train.iloc[va_idx])] + cols_va).astype(np.float32)
    x_te = np.column_stack([base(test)] + cols_te).astype(np.float32)
    mu, sd = x_tr.mean(0), x_tr.std(0) + 1e-6
    return (x_tr - mu) / sd, (x_va - mu) / sd, (x_te - mu) / sd, enc


@torch.no_grad()
def predict_rows(model, x_num, x_cat, device):
    """Predict the rows rank::world on this rank, return the full vector on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = np.arange(rank, len(x_num), world)
    model.eval()
    out = [model(torch.from_numpy(x_num[rows[s:s + 8192]]).to(device),
                 torch.from_numpy(x_cat[rows[s:s + 8192]]).to(device)).float().cpu()
           for s in range(0, len(rows), 8192)]
    parts = [None] * world
    dist.all_gather_object(parts, (rows, torch.cat(out).numpy() if out else np.zeros(0, np.float32)))
    full = np.zeros(len(x_num), np.float32)
    for r, p in parts:
        full[r] = p
    return full


def train_stage(args, train, test, cards, y_log, device, local_rank):
    rank, world = dist.get_rank(), dist.get_world_size()
    x_cat = train[LOW_CARD].values.astype(np.int64)
    oof = np.zeros(len(train), np.float32)
    for fold, (tr_idx, va_idx) in enumerate(KFold(args.folds, shuffle=True, random_state=args.seed).split(train)):
        x_tr, x_va, x_te, enc = fold_numeric(train, test, tr_idx, va_idx, y_log, args.seed)
        y_mu = float(y_log[tr_idx].mean())
        ds = TensorDataset(torch.from_numpy(x_tr), torch.from_numpy(x_cat[tr_idx]),
                           torch.from_numpy((y_log[tr_idx] - y_mu).astype(np.float32)))
        sampler = DistributedSampler(ds, shuffle=True, seed=args.seed, drop_last=True)
        loader = DataLoader(ds, batch_size=args.batch_size // world, sampler=sampler, num_workers=2, drop_last=True)
        model = DDP(FTTransformer(x_tr.shape[1], cards).to(device), device_ids=[local_rank])
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, total_steps=args.epochs * len(loader), pct_start=0.1)
        best = np.inf
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            for xn, xc, yb in loader:
                xn, xc, yb = xn.to(device), xc.to(device), yb.to(device)
                loss = F.mse_loss(model(xn, xc), yb)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
            pred = predict_rows(model.module, x_va, x_cat[va_idx], device) + y_mu
            rmse = float(np.sqrt(np.mean((pred - y_log[va_idx]) ** 2)))
            if rmse < best:
                best = rmse
                oof[va_idx] = pred
                if rank == 0:
                    torch.save({"model": model.state_dict(), "y_mu": y_mu, "n_num": x_tr.shape[1]},
                               os.path.join(args.out, f"fold{fold}.pt"))
                    with open(os.path.join(args.out, f"fold{fold}_te.pkl"), "wb") as f:
                        pickle.dump(enc, f)
            if rank == 0:
                print(f"fold {fold} epoch {epoch:02d} train_mse {loss.item():.4f} val_rmse(log) {rmse:.4f}", flush=True)
    if rank == 0:
        print(f"OOF RMSE (log price) {np.sqrt(np.mean((oof - y_log) ** 2)):.5f}", flush=True)
        np.save(os.path.join(args.out, "oof_log.npy"), oof)
    dist.barrier()


def predict_stage(args, train, test, cards, y_log, device):
    rank = dist.get_rank()
    x_cat_te = test[LOW_CARD].values.astype(np.int64)
    total = np.zeros(len(test), np.float32)
    for fold, (tr_idx, va_idx) in enumerate(KFold(args.folds, shuffle=True, random_state=args.seed).split(train)):
        _, _, x_te, _ = fold_numeric(train, test, tr_idx, va_idx, y_log, args.seed)
        ckpt = torch.load(os.path.join(args.out, f"fold{fold}.pt"), map_location=device)
        model = FTTransformer(ckpt["n_num"], cards).to(device)
        model.load_state_dict(ckpt["model"])
        total += predict_rows(model, x_te, x_cat_te, device) + ckpt["y_mu"]
    if rank == 0:
        price = np.expm1(total / args.folds)
        pd.DataFrame({"id": test["id"], "price": price}).to_csv(os.path.join(args.out, "submission.csv"), index=False)
        print(f"wrote {len(price)} test predictions", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", choices=["train", "predict", "all"], default="all")
    ap.add_argument("--train", required=True)
    ap.add_argument("--test", required=True)
    ap.add_argument("--out", default="runs/cars_ftt")
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--batch-size", type=int, default=1024, help="global")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--seed", type=int, default=2024)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    if dist.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
    dist.barrier()

    train, test = pd.read_csv(args.train), pd.read_csv(args.test)
    y_log = np.log1p(train["price"].values).astype(np.float32)
    cards = low_card_codes(train, test)
    for c in HIGH_CARD:
        train[c], test[c] = train[c].fillna("NA").astype(str), test[c].fillna("NA").astype(str)

    if args.stage in ("train", "all"):
        train_stage(args, train, test, cards, y_log, device, local_rank)
    if args.stage in ("predict", "all"):
        predict_stage(args, train, test, cards, y_log, device)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
