"""5-fold CV of an FT-Transformer on the credit default table.

Each fold is trained data-parallel over all GPUs; out-of-fold predictions are
collected on rank 0 and written to oof.csv, test predictions are averaged over folds.

    torchrun --standalone --nproc_per_node=4 02_credit_kfold_ftt.py --config configs/credit.yaml
"""
import argparse
import math
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import StratifiedKFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

DEFAULTS = dict(
    train_csv="data/credit/train.csv", test_csv="data/credit/test.csv", id_col="customer_id",
    target="default_12m", n_folds=5, epochs=40, batch_size=512, lr=1e-4, weight_decay=1e-5,
    d_token=96, n_blocks=3, n_heads=8, dropout=0.15, patience=6, seed=2024, out_dir="runs/credit_ftt",
)


def load_config():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default=None)
    a = p.parse_args()
    cfg = dict(DEFAULTS)
    if a.config:
        with open(a.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    return argparse.Namespace(**cfg)


class FTTransformer(nn.Module):
    def __init__(self, n_num, cardinalities, d_token=96, n_blocks=3, n_heads=8, dropout=0.15):
        super().__init__()
        self.num_w = nn.Parameter(torch.empty(n_num, d_token))
        self.num_b = nn.Parameter(torch.empty(n_num, d_token))
        self.cat_emb = nn.Embedding(sum(cardinalities), d_token)
        self.cat_b = nn.Parameter(torch.empty(len(cardinalities), d_token))
        offsets = torch.tensor([0] + list(np.cumsum(cardinalities)[:-1]), dtype=torch.long)
        self.register_buffer("cat_offsets", offsets, persistent=False)
        self.cls = nn.Parameter(torch.empty(1, 1, d_token))
        for prm in (self.num_w, self.num_b, self.cat_b, self.cls):
            nn.init.uniform_(prm, -1 / math.sqrt(d_token), 1 / math.sqrt(d_token))
        layer = nn.TransformerEncoderLayer(d_token, n_heads, dim_feedforward=int(d_token * 4 / 3),
                                           dropout=dropout, activation="gelu", batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, n_blocks)
        self.head = nn.Sequential(nn.LayerNorm(d_token), nn.ReLU(), nn.Linear(d_token, 1))

    def forward(self, x_num, x_cat):
        t_num = x_num.unsqueeze(-1) * self.num_w + self.num_b
        t_cat = self.cat_emb(x_cat + self.cat_offsets) + self.cat_b
        tokens = torch.cat([self.cls.expand(x_num.size(0), -1, -1), t_num, t_cat], dim=1)
        return self.head(self.blocks(tokens)[:, 0]).squeeze(-1)


def preprocess(train, test, cfg):
    cat_cols = [c for c in train.columns if train[c].dtype == object and c not in (cfg.id_col,)]
    num_cols = [c for c in train.columns if c not in cat_cols + [cfg.id_col, cfg.target]]
    cards = []
    for c in cat_cols:
        # categories are sorted by pandas, so every rank gets the same codes
        cats = pd.Index(sorted(train[c].fillna("NA").astype(str).unique()))
        train[c] = pd.Categorical(train[c].fillna("NA").astype(str), categories=cats).codes + 1
        test[c] = pd.Categorical(test[c].fillna("NA").astype(str), categories=cats).codes + 1
        cards.append(len(cats) + 1)
    med = train[num_cols].median()
    train[num_cols] = train[num_cols].fillna(med)
    test[num_cols] = test[num_cols].fillna(med)
    return num_cols, cat_cols, cards


def to_tensors(df, num_cols, cat_cols, mean, std, target=None):
    x_num = torch.tensor(((df[num_cols].values - mean) / std).astype(np.float32))
    x_cat = torch.tensor(df[cat_cols].values.astype(np.int64))
    idx = torch.arange(len(df))
    y = torch.tensor(df[target].values.astype(np.float32)) if target else torch.zeros(len(df))
    return TensorDataset(idx, x_num, x_cat, y)


@torch.no_grad()
def predict_all(model, ds, batch_size, device, world_size):
    sampler = DistributedSampler(ds, shuffle=False)
    loader = DataLoader(ds, batch_size=batch_size, sampler=sampler, num_workers=2)
    model.eval()
    ids, preds = [], []
    for idx, x_num, x_cat, _ in loader:
        p = torch.sigmoid(model(x_num.to(device), x_cat.to(device)))
        ids.append(idx.numpy())
        preds.append(p.float().cpu().numpy())
    gathered = [None] * world_size
    dist.all_gather_object(gathered, (np.concatenate(ids), np.concatenate(preds)))
    all_ids = np.concatenate([g[0] for g in gathered])
    all_preds = np.concatenate([g[1] for g in gathered])
    out = np.empty(len(ds), dtype=np.float32)
    out[all_ids] = all_preds  # padded duplicates write the same value twice
    return out


def train_fold(fold, tr_ds, va_ds, y_va, te_ds, n_num, cards, cfg, rank, local_rank, world_size):
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(cfg.seed + fold)
    model = FTTransformer(n_num, cards, cfg.d_token, cfg.n_blocks, cfg.n_heads, cfg.dropout).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr * world_size, weight_decay=cfg.weight_decay)
    sampler = DistributedSampler(tr_ds, shuffle=True, seed=cfg.seed + fold, drop_last=True)
    loader = DataLoader(tr_ds, batch_size=cfg.batch_size, sampler=sampler, num_workers=4, pin_memory=True)
    ckpt = os.path.join(cfg.out_dir, f"fold{fold}.pt")

    best, wait = -np.inf, 0
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for _, x_num, x_cat, y in loader:
            x_num, x_cat, y = x_num.to(device), x_cat.to(device), y.to(device)
            loss = F.binary_cross_entropy_with_logits(model(x_num, x_cat), y)
            opt.zero_grad()
            loss.backward()
            opt.step()

        va_pred = predict_all(model, va_ds, 2048, device, world_size)
        auc = roc_auc_score(y_va, va_pred)  # identical on every rank after the gather
        if auc > best:
            best, wait = auc, 0
            if rank == 0:
                torch.save(model.module.state_dict(), ckpt)
        else:
            wait += 1
        if rank == 0:
            print(f"fold {fold} epoch {epoch:02d} val_auc {auc:.5f} best {best:.5f}", flush=True)
        if wait >= cfg.patience:
            break

    dist.barrier()
    model.module.load_state_dict(torch.load(ckpt, map_location=device))
    return predict_all(model, va_ds, 2048, device, world_size), predict_all(model, te_ds, 2048, device, world_size), best


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
    dist.barrier()

    train = pd.read_csv(cfg.train_csv)
    test = pd.read_csv(cfg.test_csv)
    num_cols, cat_cols, cards = preprocess(train, test, cfg)
    y = train[cfg.target].values

    oof = np.zeros(len(train), dtype=np.float32)
    test_pred = np.zeros(len(test), dtype=np.float32)
    skf = StratifiedKFold(n_splits=cfg.n_folds, shuffle=True, random_state=cfg.seed)
    fold_scores = []
    for fold, (tr_idx, va_idx) in enumerate(skf.split(train, y)):
        tr, va = train.iloc[tr_idx], train.iloc[va_idx]
        mean = tr[num_cols].mean().values
        std = tr[num_cols].std().values + 1e-6
        tr_ds = to_tensors(tr, num_cols, cat_cols, mean, std, cfg.target)
        va_ds = to_tensors(va, num_cols, cat_cols, mean, std, cfg.target)
        te_ds = to_tensors(test, num_cols, cat_cols, mean, std)
        va_pred, te_pred, score = train_fold(fold, tr_ds, va_ds, y[va_idx], te_ds, len(num_cols), cards,
                                             cfg, rank, local_rank, world_size)
        oof[va_idx] = va_pred
        test_pred += te_pred / cfg.n_folds
        fold_scores.append(score)

    if rank == 0:
        print(f"fold AUCs {np.round(fold_scores, 5)}  OOF AUC {roc_auc_score(y, oof):.5f}")
        pd.DataFrame({cfg.id_col: train[cfg.id_col], "oof": oof, cfg.target: y}).to_csv(
            os.path.join(cfg.out_dir, "oof.csv"), index=False)
        pd.DataFrame({cfg.id_col: test[cfg.id_col], "pred": test_pred}).to_csv(
            os.path.join(cfg.out_dir, "test_pred.csv"), index=False)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
