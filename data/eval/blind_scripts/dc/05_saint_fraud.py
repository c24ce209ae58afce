"""SAINT (column + intersample attention) for transaction fraud, with a preprocessing cache.

The raw table is ~60M rows of parquet; encoding + quantile normalisation takes ~20 minutes,
so the encoded arrays are cached next to the data and reused by later sweeps.

torchrun --nproc_per_node=8 05_saint_fraud.py --data-dir /shared/fraud/parquet \
    --cache-dir /shared/fraud/cache --out /shared/runs/saint_fraud
"""
import argparse
import glob
import hashlib
import json
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import average_precision_score, roc_auc_score
from sklearn.preprocessing import QuantileTransformer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

CAT = ["merchant_id", "mcc", "country", "channel", "card_brand", "device_type", "entry_mode"]
NUM = ["amount", "amount_usd", "hour_sin", "hour_cos", "acct_age_days", "txn_cnt_1h", "txn_cnt_24h",
       "amt_sum_24h", "dist_home_km", "mins_since_last"]
TARGET = "is_fraud"


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--val-days", type=int, default=14)
    ap.add_argument("--min-freq", type=int, default=50)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--global-batch", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--seed", type=int, default=1)
    return ap.parse_args()


def cache_key(args):
    files = sorted(glob.glob(os.path.join(args.data_dir, "*.parquet")))
    h = hashlib.md5()
    for f in files:
        h.update(f.encode())
        h.update(str(os.path.getmtime(f)).encode())
    h.update(f"{args.val_days}-{args.min_freq}".encode())
    return h.hexdigest()[:12]


def preprocess(args, cache_path):
    files = sorted(glob.glob(os.path.join(args.data_dir, "*.parquet")))
    df = pd.concat([pd.read_parquet(f, columns=CAT + NUM + [TARGET, "event_ts"]) for f in files], ignore_index=True)
    df = df.sort_values("event_ts", kind="stable").reset_index(drop=True)
    cutoff = df["event_ts"].max() - pd.Timedelta(days=args.val_days)
    is_val = (df["event_ts"] > cutoff).values

    vocab_sizes = []
    xc = np.zeros((len(df), len(CAT)), dtype=np.int64)
    for j, c in enumerate(CAT):
        col = df[c].astype(str)
        vc = col[~is_val].value_counts()
        keep = sorted(vc[vc >= args.min_freq].index)
        idx = pd.Index(keep).get_indexer(col)
        xc[:, j] = idx + 1
        vocab_sizes.append(len(keep) + 1)

    qt = QuantileTransformer(n_quantiles=2000, output_distribution="normal", subsample=2_000_000, random_state=0)
    xn_raw = df[NUM].fillna(0).values
    qt.fit(xn_raw[~is_val])
    xn = qt.transform(xn_raw).astype(np.float32)
    y = df[TARGET].values.astype(np.float32)

    np.savez(cache_path, xn=xn, xc=xc, y=y, is_val=is_val)
    with open(cache_path + ".meta.json", "w") as f:
        json.dump({"vocab_sizes": vocab_sizes}, f)


def load_data(args):
    os.makedirs(args.cache_dir, exist_ok=True)
    cache_path = os.path.join(args.cache_dir, f"saint_{cache_key(args)}.npz")
    if not os.path.exists(cache_path):
        preprocess(args, cache_path)
    z = np.load(cache_path)
    with open(cache_path + ".meta.json") as f:
        meta = json.load(f)
    tr, va = ~z["is_val"], z["is_val"]
    mk = lambda m: TensorDataset(torch.from_numpy(z["xn"][m]), torch.from_numpy(z["xc"][m]), torch.from_numpy(z["y"][m]))
    return mk(tr), mk(va), meta["vocab_sizes"]


class Block(nn.Module):
    def __init__(self, n_tokens, dim, heads, dropout=0.1):
        super().__init__()
        self.col = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout, batch_first=True, norm_first=True,
                                              activation="gelu")
        # intersample attention: each row attends over the other rows of the batch
        self.row = nn.TransformerEncoderLayer(n_tokens * dim, heads, 2 * dim, dropout, batch_first=True,
                                              norm_first=True, activation="gelu")

    def forward(self, x):
        b, n, d = x.shape
        x = self.col(x)
        x = self.row(x.reshape(1, b, n * d)).reshape(b, n, d)
        return x


class SAINT(nn.Module):
    def __init__(self, n_num, vocab_sizes, dim, depth, heads):
        super().__init__()
        self.num_proj = nn.ModuleList(nn.Sequential(nn.Linear(1, 100), nn.ReLU(), nn.Linear(100, dim)) for _ in range(n_num))
        self.cat_emb = nn.ModuleList(nn.Embedding(v, dim) for v in vocab_sizes)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        n_tok = 1 + n_num + len(vocab_sizes)
        self.blocks = nn.ModuleList(Block(n_tok, dim, heads) for _ in range(depth))
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 1))

    def forward(self, xn, xc):
        toks = [p(xn[:, i:i + 1]) for i, p in enumerate(self.num_proj)]
        toks += [e(xc[:, j]) for j, e in enumerate(self.cat_emb)]
        x = torch.stack(toks, 1)
        x = torch.cat([self.cls.expand(x.size(0), -1, -1), x], 1)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x[:, 0]).squeeze(-1)


@torch.no_grad()
def evaluate(model, ds, rank, world, device, bs):
    model.eval()
    xn, xc, y = ds.tensors
    idx = torch.arange(rank, len(y), world)
    scores = []
    for i in range(0, len(idx), bs):
        j = idx[i:i + bs]
        scores.append(torch.sigmoid(model(xn[j].to(device), xc[j].to(device))).float().cpu())
    parts = [None] * world
    dist.all_gather_object(parts, (idx.numpy(), torch.cat(scores).numpy()))
    all_idx = np.concatenate([p[0] for p in parts])
    all_s = np.concatenate([p[1] for p in parts])
    yt = y.numpy()[all_idx]
    return roc_auc_score(yt, all_s), average_precision_score(yt, all_s)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    t0 = time.time()
    train_ds, val_ds, vocab_sizes = load_data(args)
    if rank == 0:
        print(f"data ready in {time.time() - t0:.0f}s: train {len(train_ds)} val {len(val_ds)}", flush=True)

    model = SAINT(len(NUM), vocab_sizes, args.dim, args.depth, args.heads).to(device)
    model = DDP(model, device_ids=[local_rank])
    bs = args.global_batch // world
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=bs, sampler=sampler, num_workers=6, pin_memory=True, drop_last=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))

    pos = float(train_ds.tensors[2].mean())
    pos_weight = torch.tensor(min(50.0, (1 - pos) / pos), device=device)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for step, (xn, xc, y) in enumerate(loader):
            xn, xc, y = xn.to(device, non_blocking=True), xc.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(xn, xc), y, pos_weight=pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if rank == 0 and step % 500 == 0:
                print(f"ep {epoch} step {step}/{len(loader)} loss {loss.item():.4f}", flush=True)

        auc, ap = evaluate(model.module, val_ds, rank, world, device, bs)
        if rank == 0:
            print(f"epoch {epoch}: val AUC {auc:.5f} AP {ap:.5f}", flush=True)
            if auc > best:
                best = auc
                torch.save({"model": model.module.state_dict(), "vocab_sizes": vocab_sizes, "auc": auc},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
