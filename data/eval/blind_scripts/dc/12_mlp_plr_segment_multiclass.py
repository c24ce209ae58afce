"""MLP with periodic (PLR) numerical embeddings, multiclass customer-segment prediction.
Target: 14 named marketing segments ("urban_family", "retired_rural", "student", ...).

    torchrun --standalone --nproc_per_node=4 12_mlp_plr_segment_multiclass.py \
        --train /data/segments/train.parquet --val /data/segments/val.parquet --out runs/plr_segments
"""
import argparse
import json
import math
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import accuracy_score, f1_score
from sklearn.preprocessing import StandardScaler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

TARGET = "segment"


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--out", default="runs/plr")
    p.add_argument("--n-freq", type=int, default=48)
    p.add_argument("--freq-scale", type=float, default=0.05)
    p.add_argument("--d-num", type=int, default=24)
    p.add_argument("--d-cat", type=int, default=16)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--dropout", type=float, default=0.15)
    p.add_argument("--global-batch", type=int, default=1024)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--label-smoothing", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class PeriodicEmbedding(nn.Module):
    """PLR: x -> [sin(2 pi c x), cos(2 pi c x)] -> Linear -> ReLU, separately per feature."""

    def __init__(self, n_features, n_freq, d_out, sigma):
        super().__init__()
        self.coef = nn.Parameter(torch.randn(n_features, n_freq) * sigma)
        self.weight = nn.Parameter(torch.empty(n_features, 2 * n_freq, d_out))
        self.bias = nn.Parameter(torch.zeros(n_features, d_out))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, x):
        v = 2 * math.pi * self.coef[None] * x[..., None]
        v = torch.cat([torch.sin(v), torch.cos(v)], -1)
        return F.relu(torch.einsum("bfk,fkd->bfd", v, self.weight) + self.bias)


class PLRMLP(nn.Module):
    def __init__(self, n_num, cards, n_classes, args):
        super().__init__()
        self.num_emb = PeriodicEmbedding(n_num, args.n_freq, args.d_num, args.freq_scale)
        self.cat_emb = nn.ModuleList(nn.Embedding(c, args.d_cat) for c in cards)
        d = n_num * args.d_num + len(cards) * args.d_cat
        blocks = []
        for _ in range(args.layers):
            blocks += [nn.Linear(d, args.hidden), nn.ReLU(), nn.Dropout(args.dropout)]
            d = args.hidden
        self.mlp = nn.Sequential(*blocks)
        self.head = nn.Linear(d, n_classes)

    def forward(self, xn, xc):
        parts = [self.num_emb(xn).flatten(1)] + [e(xc[:, i]) for i, e in enumerate(self.cat_emb)]
        return self.head(self.mlp(torch.cat(parts, 1)))


def prepare(args):
    tr = pd.read_parquet(args.train)
    va = pd.read_parquet(args.val)
    cat_cols = [c for c in tr.columns if c != TARGET and tr[c].dtype == object]
    num_cols = [c for c in tr.columns if c != TARGET and c not in cat_cols]

    label2id = {lab: i for i, lab in enumerate(set(tr[TARGET]))}
    ytr = tr[TARGET].map(label2id).values.astype(np.int64)
    yva = va[TARGET].map(label2id).fillna(-100).values.astype(np.int64)

    cards = []
    xc_tr, xc_va = [], []
    for c in cat_cols:
        cats = pd.Index(tr[c].astype(str).value_counts().index.sort_values())
        cards.append(len(cats) + 1)
        xc_tr.append(cats.get_indexer(tr[c].astype(str)) + 1)
        xc_va.append(cats.get_indexer(va[c].astype(str)) + 1)

    med = tr[num_cols].median()
    sc = StandardScaler().fit(tr[num_cols].fillna(med).values)
    xn_tr = sc.transform(tr[num_cols].fillna(med).values).astype(np.float32)
    xn_va = sc.transform(va[num_cols].fillna(med).values).astype(np.float32)

    counts = np.bincount(ytr, minlength=len(label2id))
    class_w = (len(ytr) / (len(label2id) * np.maximum(counts, 1))) ** 0.5

    train_ds = TensorDataset(torch.from_numpy(xn_tr), torch.from_numpy(np.stack(xc_tr, 1)), torch.from_numpy(ytr))
    val_ds = TensorDataset(torch.from_numpy(xn_va), torch.from_numpy(np.stack(xc_va, 1)), torch.from_numpy(yva))
    return train_ds, val_ds, len(num_cols), cards, label2id, class_w


@torch.no_grad()
def evaluate(model, ds, rank, world, device):
    model.eval()
    xn, xc, y = ds.tensors
    lo = len(y) * rank // world
    hi = len(y) * (rank + 1) // world
    pred = torch.cat([model(xn[i:min(i + 8192, hi)].to(device), xc[i:min(i + 8192, hi)].to(device)).argmax(1).cpu()
                      for i in range(lo, hi, 8192)])
    parts = [None] * world
    dist.all_gather_object(parts, pred.numpy())
    pred = np.concatenate(parts)
    y = y.numpy()
    keep = y != -100
    return accuracy_score(y[keep], pred[keep]), f1_score(y[keep], pred[keep], average="macro")


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    train_ds, val_ds, n_num, cards, label2id, class_w = prepare(args)
    model = PLRMLP(n_num, cards, len(label2id), args).to(device)
    model = DDP(model, device_ids=[local_rank])

    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.global_batch // world, sampler=sampler,
                        num_workers=4, pin_memory=True, drop_last=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=3)
    weight = torch.tensor(class_w, dtype=torch.float32, device=device)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "label2id.json"), "w") as f:
            json.dump({str(k): v for k, v in label2id.items()}, f, indent=1)

    best_f1 = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for xn, xc, y in loader:
            xn, xc, y = xn.to(device, non_blocking=True), xc.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(xn, xc), y, weight=weight, label_smoothing=args.label_smoothing)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        acc, f1 = evaluate(model.module, val_ds, rank, world, device)
        sched.step(f1)  # identical on every rank: metrics come from the gathered predictions
        if rank == 0:
            print(f"epoch {epoch} acc {acc:.4f} macro_f1 {f1:.4f} lr {opt.param_groups[0]['lr']:.1e} "
                  f"{time.time() - t0:.0f}s", flush=True)
            if f1 > best_f1:
                best_f1 = f1
                torch.save({"model": model.module.state_dict(), "label2id": label2id, "cards": cards},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
