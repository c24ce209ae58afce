#!/usr/bin/env python
# Candidate-generation two-tower model for the "For You" feed.
# Trains on (user, clicked item) pairs with in-batch sampled softmax and reports
# recall@K against the full item corpus at the end of every epoch.
#
#   torchrun --nnodes=1 --nproc_per_node=4 04_two_tower_retrieval_recall.py \
#       --data_dir /shared/feed/pairs --item_file /shared/feed/items.parquet

import argparse
import math
import os
import time

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def is_main():
    return dist.get_rank() == 0


def print0(*a, **kw):
    if is_main():
        print(*a, **kw, flush=True)


def read_pairs(path):
    t = pq.read_table(path, columns=["user_id", "user_segment", "item_id", "item_category", "item_age_days"])
    cols = {n: t.column(n).to_numpy() for n in t.column_names}
    return (
        torch.from_numpy(cols["user_id"].astype(np.int64)),
        torch.from_numpy(cols["user_segment"].astype(np.int64)),
        torch.from_numpy(cols["item_id"].astype(np.int64)),
        torch.from_numpy(cols["item_category"].astype(np.int64)),
        torch.from_numpy(np.log1p(cols["item_age_days"].astype(np.float32))),
    )


class Tower(nn.Module):
    def __init__(self, in_dim, hidden, out_dim):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(in_dim, hidden), nn.LayerNorm(hidden), nn.GELU(),
            nn.Linear(hidden, out_dim),
        )

    def forward(self, x):
        return F.normalize(self.net(x), dim=-1)


class RetrievalModel(nn.Module):
    def __init__(self, n_users, n_segments, n_items, n_categories, dim=64, hidden=256):
        super().__init__()
        self.user_emb = nn.Embedding(n_users, dim)
        self.segment_emb = nn.Embedding(n_segments, 16)
        self.item_emb = nn.Embedding(n_items, dim)
        self.category_emb = nn.Embedding(n_categories, 16)
        self.user_tower = Tower(dim + 16, hidden, dim)
        self.item_tower = Tower(dim + 16 + 1, hidden, dim)
        self.log_temp = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def encode_users(self, user_id, segment):
        return self.user_tower(torch.cat([self.user_emb(user_id), self.segment_emb(segment)], -1))

    def encode_items(self, item_id, category, age):
        x = torch.cat([self.item_emb(item_id), self.category_emb(category), age.unsqueeze(-1)], -1)
        return self.item_tower(x)

    def forward(self, user_id, segment, item_id, category, age):
        u = self.encode_users(user_id, segment)
        v = self.encode_items(item_id, category, age)
        logits = u @ v.t() * self.log_temp.exp().clamp(max=100.0)
        return logits


@torch.no_grad()
def recall_at_k(model, item_table, val, device, ks=(10, 50, 200), bs=4096):
    model.eval()
    item_ids, item_cats, item_age = (t.to(device) for t in item_table)
    corpus = []
    for i in range(0, item_ids.numel(), bs):
        corpus.append(model.encode_items(item_ids[i:i + bs], item_cats[i:i + bs], item_age[i:i + bs]))
    corpus = torch.cat(corpus)

    users, segs, targets = val
    rank, world = dist.get_rank(), dist.get_world_size()
    users, segs, targets = users[rank::world], segs[rank::world], targets[rank::world]
    hits = torch.zeros(len(ks), device=device)
    for i in range(0, users.numel(), bs):
        u = model.encode_users(users[i:i + bs].to(device), segs[i:i + bs].to(device))
        top = (u @ corpus.t()).topk(max(ks), dim=-1).indices
        top_items = item_ids[top]
        tgt = targets[i:i + bs].to(device).unsqueeze(-1)
        for j, k in enumerate(ks):
            hits[j] += (top_items[:, :k] == tgt).any(-1).float().sum()
    n = torch.tensor([float(users.numel())], device=device)
    dist.all_reduce(hits)
    dist.all_reduce(n)
    model.train()
    return {f"recall@{k}": (hits[j] / n).item() for j, k in enumerate(ks)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--item_file", required=True)
    ap.add_argument("--save_dir", default="/shared/feed/ckpt/two_tower")
    ap.add_argument("--n_users", type=int, default=5_000_000)
    ap.add_argument("--n_segments", type=int, default=512)
    ap.add_argument("--n_items", type=int, default=1_200_000)
    ap.add_argument("--n_categories", type=int, default=2048)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch_size", type=int, default=2048)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--weight_decay", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    train = read_pairs(os.path.join(args.data_dir, "train.parquet"))
    val_u, val_s, val_i, _, _ = read_pairs(os.path.join(args.data_dir, "val.parquet"))
    items = pq.read_table(args.item_file, columns=["item_id", "item_category", "item_age_days"])
    item_table = (
        torch.from_numpy(items.column("item_id").to_numpy().astype(np.int64)),
        torch.from_numpy(items.column("item_category").to_numpy().astype(np.int64)),
        torch.from_numpy(np.log1p(items.column("item_age_days").to_numpy().astype(np.float32))),
    )

    ds = TensorDataset(*train)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)
    print0(f"train pairs: {len(ds):,}  val: {val_u.numel():,}  corpus: {item_table[0].numel():,}")

    model = RetrievalModel(args.n_users, args.n_segments, args.n_items, args.n_categories, args.dim).to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank])
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    total = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: min(1.0, (s + 1) / 500) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total))
    )

    if is_main():
        os.makedirs(args.save_dir, exist_ok=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for user, seg, item, cat, age in loader:
            user, seg = user.to(device, non_blocking=True), seg.to(device, non_blocking=True)
            item, cat, age = (x.to(device, non_blocking=True) for x in (item, cat, age))
            logits = model(user, seg, item, cat, age)
            # duplicated items inside a batch are false negatives; mask them out
            dup = (item.unsqueeze(0) == item.unsqueeze(1)) & ~torch.eye(item.numel(), dtype=torch.bool, device=device)
            logits = logits.masked_fill(dup, -1e4)
            target = torch.arange(logits.size(0), device=device)
            loss = F.cross_entropy(logits, target)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optim.step()
            sched.step()
            step += 1
            if step % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                print0(f"ep {epoch} step {step} loss {l.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                       f"({(time.time() - t0) / 100:.3f}s/it)")
                t0 = time.time()

        metrics = recall_at_k(model, item_table, (val_u, val_s, val_i), device)
        print0(f"epoch {epoch} " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
        if is_main():
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "metrics": metrics},
                       os.path.join(args.save_dir, f"ckpt_{epoch:02d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
