"""Wide & Deep fraud model with fresh negative downsampling every epoch.

All fraud rows are kept; legit rows are subsampled at --neg-rate with a new draw each
epoch (seeded by seed+epoch, so every rank draws the same subset and DistributedSampler
can split it). Scores are recalibrated for the sampling rate before evaluation.

    torchrun --nproc_per_node=8 17_wide_deep_epoch_negsample.py --data /data/acq/2024h1.parquet --amp
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
import wandb
from sklearn.metrics import average_precision_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

WIDE_CROSSES = [("mcc", "country"), ("mcc", "hour"), ("bin6", "country"), ("entry_mode", "mcc")]
DEEP_CATS = ["mcc", "country", "bin6", "entry_mode", "hour", "currency"]
HASH = 1 << 18


def hash_cross(df, a, b):
    v = pd.util.hash_pandas_object(df[a].astype(str) + "|" + df[b].astype(str), index=False).to_numpy()
    return (v % HASH).astype(np.int64)


def build_tensors(df, num_cols, mu, sd):
    wide = np.stack([hash_cross(df, a, b) for a, b in WIDE_CROSSES], 1)
    deep_cat = np.stack([(pd.util.hash_pandas_object(df[c].astype(str), index=False).to_numpy() % HASH)
                         .astype(np.int64) for c in DEEP_CATS], 1)
    num = ((df[num_cols].fillna(0).to_numpy(np.float32) - mu) / sd).astype(np.float32)
    y = df["is_fraud"].to_numpy(np.float32)
    return TensorDataset(torch.from_numpy(wide), torch.from_numpy(deep_cat), torch.from_numpy(num),
                         torch.from_numpy(y))


class WideDeep(nn.Module):
    def __init__(self, n_num, emb=16, hidden=(256, 128)):
        super().__init__()
        self.wide = nn.EmbeddingBag(HASH, 1, mode="sum")
        self.deep_emb = nn.ModuleList(nn.Embedding(HASH, emb) for _ in DEEP_CATS)
        d = emb * len(DEEP_CATS) + n_num
        layers = []
        for h in hidden:
            layers += [nn.Linear(d, h), nn.ReLU(), nn.Dropout(0.1)]
            d = h
        self.deep = nn.Sequential(*layers, nn.Linear(d, 1))

    def forward(self, wide, deep_cat, num):
        w = self.wide(wide).squeeze(-1)
        e = torch.cat([m(deep_cat[:, i]) for i, m in enumerate(self.deep_emb)] + [num], dim=1)
        return w + self.deep(e).squeeze(-1)


def epoch_subset(y, neg_rate, seed, epoch):
    rng = np.random.default_rng(seed + epoch)
    keep = (y == 1) | (rng.random(len(y)) < neg_rate)
    return np.flatnonzero(keep)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="/shared/fraud/widedeep")
    ap.add_argument("--cutoff", default="2024-05-15")
    ap.add_argument("--neg-rate", type=float, default=0.05)
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--amp", action="store_true")
    ap.add_argument("--resume", default="")
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    df = pd.read_parquet(args.data)
    df["hour"] = pd.to_datetime(df["ts"]).dt.hour
    is_train = pd.to_datetime(df["ts"]) < args.cutoff
    num_cols = [c for c in df.columns if c.startswith("num_")]
    mu = df.loc[is_train, num_cols].mean().to_numpy(np.float32)
    sd = df.loc[is_train, num_cols].std().to_numpy(np.float32) + 1e-6
    train_ds = build_tensors(df[is_train], num_cols, mu, sd)
    val_ds = build_tensors(df[~is_train], num_cols, mu, sd)
    y_train = train_ds.tensors[3].numpy()

    model = DDP(WideDeep(len(num_cols)).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)
    start_epoch = 0
    if args.resume:
        ck = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        scaler.load_state_dict(ck["scaler"])
        start_epoch = ck["epoch"] + 1

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project="fraud-widedeep", config=vars(args), resume="allow")

    for epoch in range(start_epoch, args.epochs):
        idx = epoch_subset(y_train, args.neg_rate, args.seed, epoch)
        sub = Subset(train_ds, idx)
        sampler = DistributedSampler(sub, shuffle=True, seed=args.seed, drop_last=True)
        sampler.set_epoch(epoch)
        loader = DataLoader(sub, batch_size=args.batch_size, sampler=sampler, num_workers=4, pin_memory=True)

        model.train()
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for wide, cat, num, y in loader:
            wide, cat, num, y = (t.to(device, non_blocking=True) for t in (wide, cat, num, y))
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                logit = model(wide, cat, num)
            loss = F.binary_cross_entropy_with_logits(logit.float(), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)

        model.eval()
        vidx = np.arange(rank, len(val_ds), world)
        vloader = DataLoader(Subset(val_ds, vidx), batch_size=16384, num_workers=2)
        s_local, y_local = [], []
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
            for wide, cat, num, y in vloader:
                s_local.append(torch.sigmoid(model.module(wide.to(device), cat.to(device), num.to(device)).float()).cpu())
                y_local.append(y)
        parts = [None] * world
        dist.all_gather_object(parts, (torch.cat(s_local).numpy(), torch.cat(y_local).numpy()))

        if rank == 0:
            p = np.concatenate([a for a, _ in parts])
            yv = np.concatenate([b for _, b in parts])
            # sampling correction: p_true = p*r / (p*r + 1 - p)
            p_cal = p * args.neg_rate / (p * args.neg_rate + 1 - p)
            ap_score, auc = average_precision_score(yv, p_cal), roc_auc_score(yv, p_cal)
            wandb.log({"epoch": epoch, "train/loss": (tot[0] / tot[1]).item(), "train/rows": len(idx),
                       "val/pr_auc": ap_score, "val/roc_auc": auc, "val/mean_score": float(p_cal.mean()),
                       "val/fraud_rate": float(yv.mean())})
            print(f"epoch {epoch}: {len(idx)} rows, loss {(tot[0] / tot[1]).item():.4f}, "
                  f"val PR-AUC {ap_score:.4f}, {time.time() - t0:.0f}s", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict(),
                        "epoch": epoch, "neg_rate": args.neg_rate,
                        "mu": torch.from_numpy(mu), "sd": torch.from_numpy(sd)},
                       os.path.join(args.out, "last.pt"))
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
