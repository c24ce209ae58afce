#!/usr/bin/env python
"""
Multi-class obesity-risk prediction (7 classes) with an FT-Transformer.
10-fold CV, DDP on one node, OOF probabilities + test probabilities saved for stacking.

    torchrun --nproc_per_node=4 11_obesity_multiclass_ftt.py --train data/obesity/train.csv \
        --test data/obesity/test.csv --out runs/obesity_ftt
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import accuracy_score, log_loss
from sklearn.model_selection import StratifiedKFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

TARGET = "NObeyesdad"
CAT_COLS = ["Gender", "family_history_with_overweight", "FAVC", "CAEC", "SMOKE", "SCC", "CALC", "MTRANS"]
NUM_COLS = ["Age", "Height", "Weight", "FCVC", "NCP", "CH2O", "FAF", "TUE"]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--test", required=True)
    p.add_argument("--out", default="runs/obesity_ftt")
    p.add_argument("--folds", type=int, default=10)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-4, help="per 128 samples")
    p.add_argument("--d-token", type=int, default=64)
    p.add_argument("--n-blocks", type=int, default=3)
    p.add_argument("--label-smoothing", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=17)
    return p.parse_args()


class FTTransformer(nn.Module):
    def __init__(self, n_num, cards, n_classes, d=64, n_blocks=3, heads=4, drop=0.1):
        super().__init__()
        self.num_w = nn.Parameter(torch.randn(n_num, d) * d ** -0.5)
        self.num_b = nn.Parameter(torch.zeros(n_num, d))
        self.cat_emb = nn.ModuleList([nn.Embedding(c, d) for c in cards])
        self.cls = nn.Parameter(torch.randn(1, 1, d) * d ** -0.5)
        layer = nn.TransformerEncoderLayer(d, heads, 2 * d, drop, activation="gelu", batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_blocks, enable_nested_tensor=False)
        self.head = nn.Sequential(nn.LayerNorm(d), nn.ReLU(), nn.Linear(d, n_classes))

    def forward(self, x_num, x_cat):
        tok_num = x_num.unsqueeze(-1) * self.num_w + self.num_b
        tok_cat = torch.stack([emb(x_cat[:, i]) for i, emb in enumerate(self.cat_emb)], 1)
        x = torch.cat([self.cls.expand(x_num.size(0), -1, -1), tok_num, tok_cat], 1)
        return self.head(self.encoder(x)[:, 0])


def feature_engineering(df):
    df = df.copy()
    df["BMI"] = df["Weight"] / df["Height"] ** 2
    return df


@torch.no_grad()
def predict_proba(model, x_num, x_cat, device, bs=4096):
    model.eval()
    out = []
    for s in range(0, len(x_num), bs):
        logits = model(x_num[s:s + bs].to(device), x_cat[s:s + bs].to(device))
        out.append(F.softmax(logits.float(), -1).cpu())
    return torch.cat(out).numpy() if out else np.zeros((0, model.head[-1].out_features), np.float32)


def sharded_predict(model, x_num, x_cat, device):
    """Each rank predicts rows rank::world; every rank gets back the full matrix."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = np.arange(rank, len(x_num), world)
    p = predict_proba(model, x_num[rows], x_cat[rows], device)
    parts = [None] * world
    dist.all_gather_object(parts, (rows, p))
    full = np.zeros((len(x_num), p.shape[1]), np.float32)
    for r, q in parts:
        full[r] = q
    return full


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    train = feature_engineering(pd.read_csv(args.train))
    test = feature_engineering(pd.read_csv(args.test))
    num_cols = NUM_COLS + ["BMI"]

    classes = list(set(train[TARGET]))
    label2id = {c: i for i, c in enumerate(classes)}
    y = train[TARGET].map(label2id).values.astype(np.int64)

    cards = []
    x_cat_tr, x_cat_te = [], []
    for c in CAT_COLS:
        codes, uniques = pd.factorize(pd.concat([train[c], test[c]], ignore_index=True))
        x_cat_tr.append(codes[: len(train)] + 1)
        x_cat_te.append(codes[len(train):] + 1)  # -1 (NaN) -> 0
        cards.append(len(uniques) + 1)
    x_cat_tr = torch.from_numpy(np.stack(x_cat_tr, 1).astype(np.int64))
    x_cat_te = torch.from_numpy(np.stack(x_cat_te, 1).astype(np.int64))

    oof = np.zeros((len(train), len(classes)), np.float32)
    test_proba = np.zeros((len(test), len(classes)), np.float32)
    skf = StratifiedKFold(args.folds, shuffle=True, random_state=args.seed)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for fold, (tr_idx, va_idx) in enumerate(skf.split(train, y)):
        mu = train.iloc[tr_idx][num_cols].mean()
        sd = train.iloc[tr_idx][num_cols].std()
        x_num_tr = torch.tensor(((train[num_cols] - mu) / sd).values, dtype=torch.float32)
        x_num_te = torch.tensor(((test[num_cols] - mu) / sd).values, dtype=torch.float32)

        ds = TensorDataset(x_num_tr[tr_idx], x_cat_tr[tr_idx], torch.from_numpy(y[tr_idx]))
        sampler = DistributedSampler(ds, shuffle=True, seed=args.seed + fold, drop_last=True)
        loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=2, drop_last=True, pin_memory=True)

        model = DDP(FTTransformer(len(num_cols), cards, len(classes), args.d_token, args.n_blocks).to(device),
                    device_ids=[local_rank])
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr * world, weight_decay=1e-5)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr * world, epochs=args.epochs,
                                                    steps_per_epoch=len(loader), pct_start=0.1)

        best_ll, best_state = np.inf, None
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            t0 = time.time()
            for xn, xc, yb in loader:
                xn, xc, yb = xn.to(device, non_blocking=True), xc.to(device, non_blocking=True), yb.to(device, non_blocking=True)
                loss = F.cross_entropy(model(xn, xc), yb, label_smoothing=args.label_smoothing)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()

            proba = sharded_predict(model.module, x_num_tr[va_idx], x_cat_tr[va_idx], device)
            ll = log_loss(y[va_idx], proba, labels=list(range(len(classes))))
            acc = accuracy_score(y[va_idx], proba.argmax(1))
            if rank == 0:
                print(f"fold {fold} ep {epoch:02d} loss {loss.item():.4f} val_logloss {ll:.4f} "
                      f"val_acc {acc:.4f} {time.time() - t0:.1f}s", flush=True)
            if ll < best_ll:
                best_ll = ll
                oof[va_idx] = proba
                best_state = {k: v.detach().cpu().clone() for k, v in model.module.state_dict().items()}

        model.module.load_state_dict(best_state)
        test_proba += sharded_predict(model.module, x_num_te, x_cat_te, device) / args.folds
        if rank == 0:
            torch.save({"state_dict": best_state, "classes": classes}, os.path.join(args.out, f"fold{fold}.pt"))
            print(f"fold {fold} best logloss {best_ll:.4f}", flush=True)

    if rank == 0:
        print(f"OOF accuracy {accuracy_score(y, oof.argmax(1)):.4f}  logloss {log_loss(y, oof):.4f}")
        np.save(os.path.join(args.out, "oof_proba.npy"), oof)
        np.save(os.path.join(args.out, "test_proba.npy"), test_proba)
        pd.DataFrame({"id": test["id"], TARGET: [classes[k] for k in test_proba.argmax(1)]}).to_csv(
            os.path.join(args.out, "submission.csv"), index=False)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
