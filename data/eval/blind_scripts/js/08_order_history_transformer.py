"""E-commerce order fraud: Transformer over the customer's previous orders.

Each row of the orders table carries the last 32 orders of the customer as padded
list columns (built by the feature pipeline). Legit orders are downsampled to
`--neg-per-pos` negatives per fraud order for training; validation keeps the natural rate.

    torchrun --nproc_per_node=4 08_order_history_transformer.py --orders /data/orders/v7
"""
import argparse
import math
import os
import random
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import average_precision_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

HIST = 32
HIST_NUM = ["hist_amount", "hist_dt_hours", "hist_items", "hist_refund"]
HIST_CAT = ["hist_category", "hist_payment", "hist_ship_country"]
CUR_NUM = ["amount", "items", "account_age_days", "addr_mismatch", "email_age_days", "ip_risk"]


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def downsample_negatives(df, neg_per_pos):
    pos = df[df["is_fraud"] == 1]
    neg = df[df["is_fraud"] == 0]
    n_keep = min(len(neg), neg_per_pos * len(pos))
    neg = neg.sample(n=n_keep)
    return pd.concat([pos, neg]).sample(frac=1.0).reset_index(drop=True)


class OrderDataset(Dataset):
    def __init__(self, df):
        self.hnum = np.stack([np.stack(df[c].values) for c in HIST_NUM], -1).astype(np.float32)
        self.hnum = np.sign(self.hnum) * np.log1p(np.abs(self.hnum))
        self.hcat = np.stack([np.stack(df[c].values) for c in HIST_CAT], -1).astype(np.int64)
        self.hlen = df["hist_len"].values.astype(np.int64)
        self.cur = df[CUR_NUM].fillna(0).values.astype(np.float32)
        self.cur = np.sign(self.cur) * np.log1p(np.abs(self.cur))
        self.y = df["is_fraud"].values.astype(np.float32)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        mask = np.arange(HIST) >= self.hlen[i]   # True = padding
        return self.hnum[i], self.hcat[i], mask, self.cur[i], self.y[i]


class OrderHistoryTransformer(nn.Module):
    def __init__(self, d_model=128, nhead=4, layers=3, cat_vocab=(512, 64, 256), dropout=0.1):
        super().__init__()
        self.num_proj = nn.Linear(len(HIST_NUM), d_model)
        self.cat_embs = nn.ModuleList(nn.Embedding(v, d_model, padding_idx=0) for v in cat_vocab)
        self.pos = nn.Parameter(torch.randn(1, HIST + 1, d_model) * 0.02)
        self.cls = nn.Parameter(torch.zeros(1, 1, d_model))
        enc_layer = nn.TransformerEncoderLayer(d_model, nhead, 4 * d_model, dropout, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(enc_layer, layers)
        self.cur_mlp = nn.Sequential(nn.Linear(len(CUR_NUM), d_model), nn.GELU())
        self.head = nn.Sequential(nn.LayerNorm(2 * d_model), nn.Linear(2 * d_model, d_model), nn.GELU(),
                                  nn.Dropout(dropout), nn.Linear(d_model, 1))

    def forward(self, hnum, hcat, pad_mask, cur):
        tok = self.num_proj(hnum)
        for j, emb in enumerate(self.cat_embs):
            tok = tok + emb(hcat[..., j])
        tok = torch.cat([self.cls.expand(tok.size(0), -1, -1), tok], dim=1) + self.pos
        mask = torch.cat([torch.zeros_like(pad_mask[:, :1]), pad_mask], dim=1)
        h = self.encoder(tok, src_key_padding_mask=mask)[:, 0]
        return self.head(torch.cat([h, self.cur_mlp(cur)], dim=-1)).squeeze(-1)


def lr_lambda(warmup, total):
    def f(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
    return f


@torch.no_grad()
def evaluate(model, ds, device, rank, world, bs=2048):
    model.eval()
    sub = torch.utils.data.Subset(ds, range(rank, len(ds), world))
    dl = DataLoader(sub, batch_size=bs, num_workers=2)
    out = []
    for hnum, hcat, mask, cur, y in dl:
        logit = model.module(hnum.to(device), hcat.to(device), mask.to(device), cur.to(device))
        out.append(np.stack([torch.sigmoid(logit).cpu().numpy(), y.numpy()], 1))
    gathered = [None] * world
    dist.all_gather_object(gathered, np.concatenate(out))
    arr = np.concatenate(gathered)
    return average_precision_score(arr[:, 1], arr[:, 0]), roc_auc_score(arr[:, 1], arr[:, 0])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--orders", required=True)
    p.add_argument("--out", default="ckpts/order_tf")
    p.add_argument("--train-end", default="2024-05-01")
    p.add_argument("--val-end", default="2024-06-01")
    p.add_argument("--neg-per-pos", type=int, default=20)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup-steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=2024)
    args = p.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    set_seed(args.seed + rank)

    df = pd.read_parquet(args.orders)
    df["created_at"] = pd.to_datetime(df["created_at"])
    train_df = df[df["created_at"] < args.train_end]
    val_df = df[(df["created_at"] >= args.train_end) & (df["created_at"] < args.val_end)]
    train_df = downsample_negatives(train_df, args.neg_per_pos)
    if rank == 0:
        print(f"train rows after downsampling: {len(train_df)} (fraud {int(train_df.is_fraud.sum())}), "
              f"val rows: {len(val_df)} (fraud rate {val_df.is_fraud.mean():.4%})", flush=True)

    train_ds, val_ds = OrderDataset(train_df), OrderDataset(val_df)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    model = DDP(OrderHistoryTransformer().to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args.warmup_steps, args.epochs * len(loader)))
    loss_fn = nn.BCEWithLogitsLoss()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, run = time.time(), torch.zeros(2, device=device)
        for hnum, hcat, mask, cur, y in loader:
            hnum, hcat, mask = hnum.to(device, non_blocking=True), hcat.to(device), mask.to(device)
            cur, y = cur.to(device), y.to(device)
            loss = loss_fn(model(hnum, hcat, mask, cur), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(run)

        ap, auc = evaluate(model, val_ds, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch} train_loss {run[0].item() / run[1].item():.4f} val_ap {ap:.4f} "
                  f"val_auc {auc:.4f} time {time.time() - t0:.0f}s", flush=True)
            if ap > best:
                best = ap
                torch.save({"model": model.module.state_dict(), "args": vars(args), "epoch": epoch, "val_ap": ap},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
