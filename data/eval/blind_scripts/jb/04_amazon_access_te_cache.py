"""
Amazon employee access challenge: all-categorical data.

Per fold we compute smoothed target encodings + frequency encodings for every
column (expensive on the full 8-way interaction set), cache them as parquet,
and train an FT-Transformer-style model on [categorical tokens | encoded numerics].

usage:
    torchrun --nproc_per_node=4 04_amazon_access_te_cache.py --train data/amazon/train.csv \
        --cache-dir cache/amazon_te --out-dir runs/amazon_ftt
"""
import argparse
import itertools
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import StratifiedKFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

BASE_COLS = ["RESOURCE", "MGR_ID", "ROLE_ROLLUP_1", "ROLE_ROLLUP_2", "ROLE_DEPTNAME",
             "ROLE_TITLE", "ROLE_FAMILY_DESC", "ROLE_FAMILY", "ROLE_CODE"]


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--cache-dir", default="cache/amazon_te")
    ap.add_argument("--out-dir", default="runs/amazon_ftt")
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--bs", type=int, default=256, help="per-GPU")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--min-count", type=int, default=2)
    ap.add_argument("--alpha", type=float, default=10.0, help="target-encoding smoothing")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def add_pairs(df):
    for a, b in itertools.combinations(BASE_COLS, 2):
        df[f"{a}__{b}"] = df[a].astype(str) + "_" + df[b].astype(str)
    return df


def fold_features(tr, va, cols, alpha, seed):
    """Out-of-fold target encoding on the training part, full-train encoding on the valid part."""
    prior = tr["ACTION"].mean()
    tr_out = pd.DataFrame(index=tr.index)
    va_out = pd.DataFrame(index=va.index)
    inner = StratifiedKFold(5, shuffle=True, random_state=seed)
    for c in cols:
        tr_out[f"te_{c}"] = prior
        for i_tr, i_va in inner.split(tr, tr["ACTION"]):
            g = tr.iloc[i_tr].groupby(c)["ACTION"].agg(["sum", "count"])
            enc = (g["sum"] + alpha * prior) / (g["count"] + alpha)
            tr_out.iloc[i_va, tr_out.columns.get_loc(f"te_{c}")] = tr[c].iloc[i_va].map(enc).fillna(prior).values
        g = tr.groupby(c)["ACTION"].agg(["sum", "count"])
        va_out[f"te_{c}"] = va[c].map((g["sum"] + alpha * prior) / (g["count"] + alpha)).fillna(prior)
        freq = tr[c].value_counts(normalize=True)
        tr_out[f"fq_{c}"] = np.log1p(tr[c].map(freq).fillna(0) * len(tr))
        va_out[f"fq_{c}"] = np.log1p(va[c].map(freq).fillna(0) * len(tr))
    return tr_out.astype(np.float32), va_out.astype(np.float32)


def load_fold(df, fold, tr_idx, va_idx, args):
    tr_path = os.path.join(args.cache_dir, f"fold{fold}_train.parquet")
    va_path = os.path.join(args.cache_dir, f"fold{fold}_valid.parquet")
    if not (os.path.exists(tr_path) and os.path.exists(va_path)):
        os.makedirs(args.cache_dir, exist_ok=True)
        enc_cols = BASE_COLS + [c for c in df.columns if "__" in c]
        tr_feat, va_feat = fold_features(df.iloc[tr_idx], df.iloc[va_idx], enc_cols, args.alpha, args.seed)
        tr_feat.to_parquet(tr_path)
        va_feat.to_parquet(va_path)
    return pd.read_parquet(tr_path), pd.read_parquet(va_path)


class AccessNet(nn.Module):
    def __init__(self, cards, n_num, d, layers, heads=8, dropout=0.1):
        super().__init__()
        self.embs = nn.ModuleList([nn.Embedding(c, d) for c in cards])
        self.num_proj = nn.Linear(1, d)
        self.num_pos = nn.Parameter(torch.zeros(n_num, d))
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        block = nn.TransformerEncoderLayer(d, heads, 2 * d, dropout, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 1))

    def forward(self, x_cat, x_num):
        cat = torch.stack([e(x_cat[:, i]) for i, e in enumerate(self.embs)], dim=1)
        num = self.num_proj(x_num.unsqueeze(-1)) + self.num_pos
        x = torch.cat([self.cls.expand(x_cat.size(0), -1, -1), cat, num], dim=1)
        return self.head(self.blocks(x)[:, 0]).squeeze(-1)


def encode_categories(df, min_count):
    """Rare levels -> 0; ids assigned by sorted value so they are identical on every rank."""
    codes, cards = {}, []
    for c in BASE_COLS:
        vc = df[c].value_counts()
        keep = np.sort(vc[vc >= min_count].index.values)
        m = {v: i + 1 for i, v in enumerate(keep)}
        codes[c] = df[c].map(m).fillna(0).astype(np.int64).values
        cards.append(len(keep) + 1)
    return np.stack([codes[c] for c in BASE_COLS], 1), cards


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    df = add_pairs(pd.read_csv(args.train))
    x_cat_all, cards = encode_categories(df, args.min_count)
    y_all = df["ACTION"].values.astype(np.float32)
    folds = list(StratifiedKFold(args.folds, shuffle=True, random_state=args.seed).split(df, y_all))
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)

    oof = np.zeros(len(df), dtype=np.float32)
    for fold, (tr_idx, va_idx) in enumerate(folds):
        tr_feat, va_feat = load_fold(df, fold, tr_idx, va_idx, args)
        mu, sd = tr_feat.mean(), tr_feat.std() + 1e-6
        x_tr = torch.from_numpy(((tr_feat - mu) / sd).values.astype(np.float32))
        x_va = torch.from_numpy(((va_feat - mu) / sd).values.astype(np.float32))
        train_ds = TensorDataset(torch.from_numpy(x_cat_all[tr_idx]), x_tr, torch.from_numpy(y_all[tr_idx]))
        sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
        loader = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=4, pin_memory=True,
                            drop_last=True)

        net = AccessNet(cards, x_tr.shape[1], args.d, args.layers).to(dev)
        model = DDP(net, device_ids=[local_rank])
        opt = torch.optim.Adam(model.parameters(), lr=args.lr * world)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / (2 * len(loader))))

        shard = np.array_split(np.arange(len(va_idx)), world)[rank]
        xc_va = torch.from_numpy(x_cat_all[va_idx][shard]).to(dev)
        xn_va = x_va[shard].to(dev)
        best_auc = 0.0
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            for xc, xn, yb in loader:
                xc, xn, yb = xc.to(dev, non_blocking=True), xn.to(dev, non_blocking=True), yb.to(dev, non_blocking=True)
                loss = F.binary_cross_entropy_with_logits(model(xc, xn), yb)
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()

            net.eval()
            with torch.no_grad():
                p = torch.cat([torch.sigmoid(net(xc_va[i:i + 4096], xn_va[i:i + 4096]))
                               for i in range(0, len(shard), 4096)]).cpu().numpy()
            parts = [None] * world
            dist.all_gather_object(parts, (shard, p))
            fold_pred = np.empty(len(va_idx), dtype=np.float32)
            for s, q in parts:
                fold_pred[s] = q
            auc = roc_auc_score(y_all[va_idx], fold_pred)
            if rank == 0:
                print(f"fold {fold} ep {epoch} loss {loss.item():.4f} auc {auc:.5f}", flush=True)
            if auc > best_auc:
                best_auc = auc
                oof[va_idx] = fold_pred
                if rank == 0:
                    torch.save(net.state_dict(), os.path.join(args.out_dir, f"fold{fold}.pt"))
        if rank == 0:
            print(f"fold {fold} best auc {best_auc:.5f}", flush=True)

    if rank == 0:
        print(f"CV AUC {roc_auc_score(y_all, oof):.5f}")
        np.save(os.path.join(args.out_dir, "oof.npy"), oof)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
