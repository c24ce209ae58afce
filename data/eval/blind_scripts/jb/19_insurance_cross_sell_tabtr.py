#!/usr/bin/env python
"""Health-insurance cross-sell (Playground S4E7): TabTransformer with k-fold CV on 4-8 GPUs.

The training set is ~11M rows, so both training and out-of-fold inference are
split over the GPUs; fold predictions are assembled with all_gather.

    torchrun --nproc_per_node=8 19_insurance_cross_sell_tabtr.py --train /data/s4e7/train.parquet
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
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import StratifiedKFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

CAT = ["Gender", "Driving_License", "Region_Code", "Previously_Insured", "Vehicle_Age",
       "Vehicle_Damage", "Policy_Sales_Channel", "Age_bin", "Vintage_bin"]
NUM = ["Age", "Annual_Premium", "Vintage"]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--out", default="runs/s4e7_tabtr")
    p.add_argument("--folds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=4096, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3, help="for 8 GPUs")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--seed", type=int, default=123)
    p.add_argument("--amp", action="store_true")
    return p.parse_args()


class TabTransformer(nn.Module):
    def __init__(self, cards, n_num, dim=32, depth=3, heads=4, drop=0.05):
        super().__init__()
        self.register_buffer("offsets", torch.tensor(np.r_[0, np.cumsum(cards)[:-1]], dtype=torch.long))
        self.embedding = nn.Embedding(int(np.sum(cards)), dim)
        self.column_embedding = nn.Parameter(torch.randn(len(cards), dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, drop, activation="gelu", batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.cont_norm = nn.LayerNorm(n_num)
        d = dim * len(cards) + n_num
        self.mlp = nn.Sequential(nn.Linear(d, 512), nn.ReLU(), nn.Dropout(drop), nn.Linear(512, 128), nn.ReLU(),
                                 nn.Linear(128, 1))

    def forward(self, x_cat, x_num):
        h = self.encoder(self.embedding(x_cat + self.offsets) + self.column_embedding)
        return self.mlp(torch.cat([h.flatten(1), self.cont_norm(x_num)], 1)).squeeze(-1)


def prepare(path):
    df = pd.read_parquet(path)
    df["Gender"] = (df["Gender"] == "Male").astype(np.int64)
    df["Vehicle_Damage"] = (df["Vehicle_Damage"] == "Yes").astype(np.int64)
    df["Vehicle_Age"] = df["Vehicle_Age"].map({"< 1 Year": 0, "1-2 Year": 1, "> 2 Years": 2}).astype(np.int64)
    df["Age_bin"] = (df["Age"] // 5).clip(4, 17).astype(np.int64) - 4
    df["Vintage_bin"] = (df["Vintage"] // 30).clip(0, 10).astype(np.int64)
    df["Region_Code"] = df["Region_Code"].astype(np.int64)
    psc = df["Policy_Sales_Channel"].astype(np.int64)
    vc = psc.value_counts()
    keep = np.sort(vc[vc >= 100].index.values)
    df["Policy_Sales_Channel"] = psc.map({v: i + 1 for i, v in enumerate(keep)}).fillna(0).astype(np.int64)
    df["Annual_Premium"] = np.log1p(df["Annual_Premium"])
    cards = [int(df[c].max()) + 1 for c in CAT]
    return df, cards


@torch.no_grad()
def predict_shard(model, x_cat, x_num, device, use_amp, bs=65536):
    model.eval()
    outs = []
    for s in range(0, len(x_cat), bs):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_amp):
            logits = model(x_cat[s:s + bs].to(device, non_blocking=True), x_num[s:s + bs].to(device, non_blocking=True))
        outs.append(torch.sigmoid(logits.float()))
    return torch.cat(outs)


def gather_fold(local, world):
    buf = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(buf, local)
    return torch.cat(buf).cpu().numpy()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True

    df, cards = prepare(args.train)
    x_cat_all = torch.from_numpy(df[CAT].values)
    y = df["Response"].values.astype(np.float32)
    oof = np.zeros(len(df), np.float32)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    skf = StratifiedKFold(args.folds, shuffle=True, random_state=args.seed)
    for fold, (tr_idx, va_idx) in enumerate(skf.split(np.zeros(len(y)), y)):
        mu, sd = df[NUM].values[tr_idx].mean(0), df[NUM].values[tr_idx].std(0)
        x_num_all = torch.from_numpy(((df[NUM].values - mu) / sd).astype(np.float32))
        ds = TensorDataset(x_cat_all[tr_idx], x_num_all[tr_idx], torch.from_numpy(y[tr_idx]))
        sampler = DistributedSampler(ds, shuffle=True, seed=args.seed + fold, drop_last=True)
        loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=8, pin_memory=True,
                            drop_last=True, persistent_workers=True)

        model = DDP(TabTransformer(cards, len(NUM), args.dim, args.depth).to(device), device_ids=[local_rank],
                    gradient_as_bucket_view=True)
        lr = args.lr * world / 8
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-5, fused=True)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=args.epochs * len(loader), pct_start=0.05)

        my_rows = np.array_split(va_idx, world)[rank]
        xc_va, xn_va = x_cat_all[my_rows].pin_memory(), x_num_all[my_rows].pin_memory()

        best = 0.0
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            t0 = time.time()
            for step, (xc, xn, yb) in enumerate(loader):
                xc, xn, yb = xc.to(device, non_blocking=True), xn.to(device, non_blocking=True), yb.to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.amp):
                    logits = model(xc, xn)
                loss = F.binary_cross_entropy_with_logits(logits.float(), yb)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                if rank == 0 and step % 500 == 0:
                    print(f"fold {fold} epoch {epoch} step {step}/{len(loader)} loss {loss.item():.4f}", flush=True)

            local = predict_shard(model.module, xc_va, xn_va, device, args.amp)
            pred = gather_fold(local, world)           # rows in va_idx order: shard 0, shard 1, ...
            auc = roc_auc_score(y[va_idx], pred)
            if rank == 0:
                print(f"fold {fold} epoch {epoch} val auc {auc:.5f} ({time.time() - t0:.0f}s)", flush=True)
            if auc > best:
                best = auc
                oof[va_idx] = pred
                if rank == 0:
                    torch.save(model.module.state_dict(), os.path.join(args.out, f"fold{fold}.pt"))
        if rank == 0:
            print(f"fold {fold} best auc {best:.5f}", flush=True)
        del model, opt, loader

    if rank == 0:
        print(f"OOF AUC {roc_auc_score(y, oof):.5f}")
        np.save(os.path.join(args.out, "oof.npy"), oof)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
