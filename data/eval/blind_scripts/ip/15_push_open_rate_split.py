#!/usr/bin/env python3
"""Open-rate model for push notifications.

One parquet dump per campaign week; a random 5% of rows is held out for validation
and early stopping.

    torchrun --nproc_per_node=4 15_push_open_rate_split.py --dump /data/push/week_2024_37.parquet
"""
import argparse
import os
import random
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

SPARSE = ["user_hash", "template_id", "campaign_id", "app_version", "os", "country",
          "language", "send_hour", "send_weekday", "last_open_bucket", "segment_id",
          "device_brand", "timezone", "channel"]
DENSE = ["days_since_install", "opens_7d", "opens_30d", "sends_7d", "sessions_7d",
         "purchases_30d", "push_ctr_90d", "minutes_since_last_session"]


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class PushDump(Dataset):
    def __init__(self, path, hash_size):
        df = pd.read_parquet(path, columns=SPARSE + DENSE + ["opened"])
        self.sparse = torch.from_numpy(df[SPARSE].to_numpy(np.int64) % hash_size)
        dense = df[DENSE].fillna(0).to_numpy(np.float32)
        self.dense = torch.from_numpy(np.sign(dense) * np.log1p(np.abs(dense)))
        self.y = torch.from_numpy(df["opened"].to_numpy(np.float32))

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.sparse[i], self.dense[i], self.y[i]


class DotProductNet(nn.Module):
    def __init__(self, hash_size, dim, top):
        super().__init__()
        self.tables = nn.ModuleList(nn.Embedding(hash_size, dim) for _ in SPARSE)
        self.dense_mlp = nn.Sequential(nn.Linear(len(DENSE), 64), nn.ReLU(), nn.Linear(64, dim), nn.ReLU())
        n = len(SPARSE) + 1
        layers, d = [], dim + n * (n - 1) // 2
        for h in top:
            layers += [nn.Linear(d, h), nn.ReLU(), nn.Dropout(0.1)]
            d = h
        self.top = nn.Sequential(*layers, nn.Linear(d, 1))
        iu = torch.triu_indices(n, n, 1)
        self.register_buffer("iu", iu, persistent=False)

    def forward(self, sparse, dense):
        d = self.dense_mlp(dense)
        t = torch.stack([d] + [tab(sparse[:, k]) for k, tab in enumerate(self.tables)], 1)
        z = torch.einsum("bid,bjd->bij", t, t)[:, self.iu[0], self.iu[1]]
        return self.top(torch.cat([d, z], 1)).squeeze(1)


@torch.no_grad()
def validate(net, loader, device, bins=2000):
    net.eval()
    acc = torch.zeros(2 * bins + 2, dtype=torch.float64, device=device)
    for sparse, dense, y in loader:
        sparse, dense, y = sparse.to(device), dense.to(device), y.to(device)
        logit = net(sparse, dense)
        acc[-2] += F.binary_cross_entropy_with_logits(logit, y, reduction="sum")
        acc[-1] += y.numel()
        b = (torch.sigmoid(logit) * bins).long().clamp(max=bins - 1)
        acc[:bins] += torch.bincount(b, weights=y.double(), minlength=bins)
        acc[bins:2 * bins] += torch.bincount(b, weights=1 - y.double(), minlength=bins)
    dist.all_reduce(acc)
    net.train()
    pos, neg = acc[:bins], acc[bins:2 * bins]
    auc = ((pos * (neg.cumsum(0) - 0.5 * neg)).sum() / (pos.sum() * neg.sum())).item()
    return (acc[-2] / acc[-1]).item(), auc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump", required=True)
    ap.add_argument("--hash_size", type=int, default=500_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--top", type=int, nargs="+", default=[256, 128])
    ap.add_argument("--valid_frac", type=float, default=0.05)
    ap.add_argument("--batch_size", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--max_epochs", type=int, default=10)
    ap.add_argument("--patience", type=int, default=2)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--out", default="/data/push/models/open_rate")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    set_seed(args.seed + rank)

    full = PushDump(args.dump, args.hash_size)
    perm = np.random.permutation(len(full))
    n_valid = int(len(full) * args.valid_frac)
    train_ds = Subset(full, perm[n_valid:].tolist())
    valid_ds = Subset(full, perm[:n_valid].tolist())
    valid_shard = Subset(valid_ds, range(rank, len(valid_ds), world))

    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                          pin_memory=True, drop_last=True)
    valid_dl = DataLoader(valid_shard, batch_size=8192, num_workers=2, pin_memory=True)

    model = DDP(DotProductNet(args.hash_size, args.dim, args.top).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best, bad_epochs = float("inf"), 0
    for epoch in range(args.max_epochs):
        sampler.set_epoch(epoch)
        t0, tot, n = time.time(), 0.0, 0
        for sparse, dense, y in train_dl:
            sparse, dense, y = sparse.to(device), dense.to(device), y.to(device)
            loss = F.binary_cross_entropy_with_logits(model(sparse, dense), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += loss.item()
            n += 1
        val_loss, val_auc = validate(model.module, valid_dl, device)
        if rank == 0:
            print(f"epoch {epoch}: train_loss {tot / max(n, 1):.5f} val_logloss {val_loss:.5f} "
                  f"val_auc {val_auc:.5f} ({time.time() - t0:.0f}s)", flush=True)
        # val_loss is already all-reduced, so every rank takes the same decision
        if val_loss < best - 1e-5:
            best, bad_epochs = val_loss, 0
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "epoch": epoch,
                            "val_logloss": val_loss, "val_auc": val_auc, "args": vars(args)},
                           os.path.join(args.out, "best.pt"))
        else:
            bad_epochs += 1
            if bad_epochs >= args.patience:
                break

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
