#!/usr/bin/env python
# Two-tower candidate retrieval (user tower / item tower), sampled softmax with
# in-batch negatives and logQ correction. Evaluated with recall@K / NDCG@K
# against the full item corpus.
import argparse
import logging
import math
import os
import time

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

log = logging.getLogger(__name__)

MAX_HIST = 50


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", default="/data/retrieval/train.parquet")
    ap.add_argument("--valid", default="/data/retrieval/valid.parquet")
    ap.add_argument("--items", default="/data/retrieval/items.parquet")
    ap.add_argument("--num-users", type=int, default=20_000_000)
    ap.add_argument("--num-items", type=int, default=3_000_000)
    ap.add_argument("--num-cats", type=int, default=5000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.05)
    ap.add_argument("--batch-size", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--topk", type=int, nargs="+", default=[50, 200])
    ap.add_argument("--save-dir", default="/mnt/shared/ckpt/two_tower")
    return ap.parse_args()


class Interactions(Dataset):
    """Rows: user_id, hist (list<int>), item_id, item_cat."""

    def __init__(self, path):
        t = pq.read_table(path, columns=["user_id", "hist", "item_id", "item_cat"])
        self.user = t.column("user_id").to_numpy()
        self.item = t.column("item_id").to_numpy()
        self.cat = t.column("item_cat").to_numpy()
        hist = t.column("hist").to_pylist()
        self.hist = np.zeros((len(hist), MAX_HIST), dtype=np.int64)
        for i, h in enumerate(hist):
            h = h[-MAX_HIST:]
            self.hist[i, :len(h)] = h

    def __len__(self):
        return len(self.user)

    def __getitem__(self, i):
        return self.user[i], self.hist[i], self.item[i], self.cat[i]


class TwoTower(nn.Module):
    def __init__(self, num_users, num_items, num_cats, dim):
        super().__init__()
        # item id 0 is padding in the history
        self.user_emb = nn.Embedding(num_users, dim)
        self.hist_emb = nn.EmbeddingBag(num_items, dim, mode="mean", padding_idx=0)
        self.item_emb = nn.Embedding(num_items, dim)
        self.cat_emb = nn.Embedding(num_cats, dim // 2)
        self.user_mlp = nn.Sequential(nn.Linear(2 * dim, 512), nn.ReLU(), nn.Linear(512, dim))
        self.item_mlp = nn.Sequential(nn.Linear(dim + dim // 2, 512), nn.ReLU(), nn.Linear(512, dim))
        for e in (self.user_emb, self.hist_emb, self.item_emb, self.cat_emb):
            nn.init.normal_(e.weight, std=0.01)

    def encode_users(self, user, hist):
        h = torch.cat([self.user_emb(user), self.hist_emb(hist)], dim=-1)
        return F.normalize(self.user_mlp(h), dim=-1)

    def encode_items(self, item, cat):
        h = torch.cat([self.item_emb(item), self.cat_emb(cat)], dim=-1)
        return F.normalize(self.item_mlp(h), dim=-1)

    def forward(self, user, hist, item, cat):
        return self.encode_users(user, hist), self.encode_items(item, cat)


def item_log_q(train_items, num_items, device):
    counts = np.bincount(train_items, minlength=num_items).astype(np.float64) + 1.0
    return torch.from_numpy(np.log(counts / counts.sum())).float().to(device)


@torch.no_grad()
def evaluate(model, valid_loader, item_ids, item_cats, topk, device):
    model.eval()
    # encode the full corpus in chunks
    corpus = []
    for s in range(0, len(item_ids), 65536):
        ids = torch.from_numpy(item_ids[s:s + 65536]).to(device)
        cats = torch.from_numpy(item_cats[s:s + 65536]).to(device)
        corpus.append(model.encode_items(ids, cats).half())
    corpus = torch.cat(corpus)

    kmax = max(topk)
    hits = torch.zeros(len(topk), device=device, dtype=torch.float64)
    ndcg = torch.zeros(len(topk), device=device, dtype=torch.float64)
    n = torch.zeros(1, device=device, dtype=torch.float64)
    for user, hist, item, _ in valid_loader:
        u = model.encode_users(user.to(device), hist.to(device)).half()
        scores = u @ corpus.T
        top = scores.topk(kmax, dim=1).indices
        target = item.to(device).unsqueeze(1)
        match = top == target
        for j, k in enumerate(topk):
            m = match[:, :k]
            hits[j] += m.any(dim=1).double().sum()
            pos = m.float().argmax(dim=1)
            ndcg[j] += (m.any(dim=1).double() / torch.log2(pos.double() + 2.0)).sum()
        n += user.size(0)
    for t in (hits, ndcg, n):
        dist.all_reduce(t)
    model.train()
    return {f"recall@{k}": (hits[j] / n).item() for j, k in enumerate(topk)} | \
           {f"ndcg@{k}": (ndcg[j] / n).item() for j, k in enumerate(topk)}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO, format=f"[rank{rank}] %(asctime)s %(message)s")

    train_ds = Interactions(args.train)
    valid_ds = Interactions(args.valid)
    items = pq.read_table(args.items, columns=["item_id", "item_cat"])
    item_ids = items.column("item_id").to_numpy().astype(np.int64)
    item_cats = items.column("item_cat").to_numpy().astype(np.int64)

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                              num_workers=8, pin_memory=True, drop_last=True)
    # every rank scores a slice of the validation users, counts are summed afterwards
    valid_loader = DataLoader(valid_ds, batch_size=1024,
                              sampler=DistributedSampler(valid_ds, shuffle=False, drop_last=True),
                              num_workers=4, pin_memory=True)

    log_q = item_log_q(train_ds.item, args.num_items, device)

    model = TwoTower(args.num_users, args.num_items, args.num_cats, args.dim).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_loader))

    writer = SummaryWriter(os.path.join(args.save_dir, "tb")) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    gstep = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for user, hist, item, cat in train_loader:
            user, hist = user.to(device, non_blocking=True), hist.to(device, non_blocking=True)
            item, cat = item.to(device, non_blocking=True), cat.to(device, non_blocking=True)
            u, v = model(user, hist, item, cat)
            logits = u @ v.T / args.temperature
            logits = logits - log_q[item].unsqueeze(0)
            # same item appearing twice in the batch is not a negative
            dup = (item.unsqueeze(0) == item.unsqueeze(1)) & ~torch.eye(len(item), dtype=torch.bool, device=device)
            logits = logits.masked_fill(dup, -1e4)
            loss = F.cross_entropy(logits, torch.arange(len(item), device=device))

            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            gstep += 1
            if rank == 0 and gstep % 100 == 0:
                writer.add_scalar("train/loss", loss.item(), gstep)
                writer.add_scalar("train/lr", sched.get_last_lr()[0], gstep)
        if rank == 0:
            log.info("epoch %d done in %.0fs", epoch, time.time() - t0)

        metrics = evaluate(model, valid_loader, item_ids, item_cats, args.topk, device)
        if rank == 0:
            log.info("epoch %d %s", epoch, " ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
            for k, v in metrics.items():
                writer.add_scalar(f"valid/{k}", v, gstep)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "metrics": metrics},
                       os.path.join(args.save_dir, f"epoch{epoch}.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
