#!/usr/bin/env python
"""SASRec on Amazon Books (5-core) with DDP.

Raw input is the reviews csv (user, asin, rating, timestamp). Sequences are built
in memory on every rank (it takes ~40 s), leave-one-out split: last item is the
test target, second to last the validation target.

    torchrun --nproc_per_node=4 03_sasrec_amazon_books.py \
        --csv data/ratings_Books_5core.csv --max-len 50 --epochs 200
"""
import argparse
import json
import os
from collections import defaultdict

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", required=True)
    ap.add_argument("--out", default="out/sasrec_books")
    ap.add_argument("--max-len", type=int, default=50)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--dropout", type=float, default=0.2)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--num-neg-eval", type=int, default=100)
    return ap.parse_args()


def load_sequences(csv_path):
    df = pd.read_csv(csv_path, names=["user", "asin", "rating", "ts"])
    df = df.sort_values(["user", "ts"], kind="mergesort")
    item2id = {asin: i + 1 for i, asin in enumerate(set(df.asin))}  # 0 = padding
    seqs = defaultdict(list)
    for u, a in zip(df.user.values, df.asin.values):
        seqs[u].append(item2id[a])
    users = sorted(seqs)
    seqs = [seqs[u] for u in users if len(seqs[u]) >= 3]
    return seqs, item2id


class TrainSeqs(Dataset):
    """Each user's history minus the val/test targets; positives are the next items."""

    def __init__(self, seqs, num_items, max_len):
        self.seqs = seqs
        self.num_items = num_items
        self.max_len = max_len

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, idx):
        s = self.seqs[idx][:-2]
        inp = s[:-1][-self.max_len:]
        pos = s[1:][-self.max_len:]
        seen = set(s)
        neg = []
        for _ in pos:
            j = np.random.randint(1, self.num_items + 1)
            while j in seen:
                j = np.random.randint(1, self.num_items + 1)
            neg.append(j)
        pad = self.max_len - len(inp)
        return (torch.tensor([0] * pad + inp), torch.tensor([0] * pad + pos),
                torch.tensor([0] * pad + neg))


class EvalSeqs(Dataset):
    def __init__(self, seqs, num_items, max_len, num_neg, split, seed=42):
        self.seqs, self.max_len, self.split = seqs, max_len, split
        rng = np.random.default_rng(seed)
        self.cands = []
        for s in seqs:
            target = s[-2] if split == "val" else s[-1]
            seen = set(s)
            negs = []
            while len(negs) < num_neg:
                j = int(rng.integers(1, num_items + 1))
                if j not in seen:
                    negs.append(j)
            self.cands.append([target] + negs)

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, idx):
        s = self.seqs[idx]
        hist = s[:-2] if self.split == "val" else s[:-1]
        hist = hist[-self.max_len:]
        hist = [0] * (self.max_len - len(hist)) + hist
        return torch.tensor(hist), torch.tensor(self.cands[idx])


class SASRec(nn.Module):
    def __init__(self, num_items, max_len, hidden, blocks, heads, dropout):
        super().__init__()
        self.item_emb = nn.Embedding(num_items + 1, hidden, padding_idx=0)
        self.pos_emb = nn.Embedding(max_len, hidden)
        self.drop = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(hidden, heads, hidden, dropout,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, blocks)
        self.norm = nn.LayerNorm(hidden)
        causal = torch.triu(torch.ones(max_len, max_len, dtype=torch.bool), diagonal=1)
        self.register_buffer("causal", causal, persistent=False)

    def encode(self, seq):
        pos = torch.arange(seq.size(1), device=seq.device).unsqueeze(0)
        x = self.item_emb(seq) * (self.item_emb.embedding_dim ** 0.5) + self.pos_emb(pos)
        keep = (seq > 0).unsqueeze(-1)
        x = self.drop(x) * keep
        x = self.encoder(x, mask=self.causal) * keep
        return self.norm(x)

    def forward(self, seq, pos, neg):
        h = self.encode(seq)
        pos_logit = (h * self.item_emb(pos)).sum(-1)
        neg_logit = (h * self.item_emb(neg)).sum(-1)
        return pos_logit, neg_logit

    def score(self, seq, cands):
        h = self.encode(seq)[:, -1]
        return torch.bmm(self.item_emb(cands), h.unsqueeze(-1)).squeeze(-1)


def seed_worker(worker_id):
    # torch seeds each worker differently; numpy has to be reseeded by hand
    np.random.seed(torch.initial_seed() % 2**32)


@torch.no_grad()
def evaluate(model, loader, device, k=10):
    model.eval()
    ndcg = torch.zeros((), device=device)
    hit = torch.zeros((), device=device)
    n = torch.zeros((), device=device)
    for hist, cands in loader:
        hist, cands = hist.to(device), cands.to(device)
        scores = model.module.score(hist, cands)
        rank = (scores > scores[:, :1]).sum(1)  # target at column 0
        in_top = rank < k
        hit += in_top.sum()
        ndcg += (in_top.float() / torch.log2(rank.float() + 2)).sum()
        n += hist.size(0)
    for t in (ndcg, hit, n):
        dist.all_reduce(t)
    model.train()
    return (ndcg / n).item(), (hit / n).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    np.random.seed(1000 + rank)
    torch.manual_seed(1000)

    seqs, item2id = load_sequences(args.csv)
    num_items = len(item2id)
    if rank == 0:
        print(f"{len(seqs)} users, {num_items} items", flush=True)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "item2id.json"), "w") as f:
            json.dump(item2id, f)

    train_ds = TrainSeqs(seqs, num_items, args.max_len)
    val_ds = EvalSeqs(seqs, num_items, args.max_len, args.num_neg_eval, "val")
    train_sampler = DistributedSampler(train_ds)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, drop_last=True, persistent_workers=True,
                              worker_init_fn=seed_worker)
    val_part = torch.utils.data.Subset(val_ds, range(rank, len(val_ds), dist.get_world_size()))
    val_loader = DataLoader(val_part, batch_size=512, num_workers=2)

    model = SASRec(num_items, args.max_len, args.hidden, args.blocks, args.heads,
                   args.dropout).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98))

    best = -1.0
    for epoch in range(1, args.epochs + 1):
        train_sampler.set_epoch(epoch)
        total, steps = 0.0, 0
        for seq, pos, neg in train_loader:
            seq, pos, neg = seq.to(device), pos.to(device), neg.to(device)
            pos_logit, neg_logit = model(seq, pos, neg)
            mask = pos > 0
            loss = (F.binary_cross_entropy_with_logits(pos_logit[mask], torch.ones_like(pos_logit[mask]))
                    + F.binary_cross_entropy_with_logits(neg_logit[mask], torch.zeros_like(neg_logit[mask])))
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
            steps += 1
        if rank == 0:
            print(f"epoch {epoch} loss {total / max(steps, 1):.4f}", flush=True)

        if epoch % args.eval_every == 0:
            ndcg, hr = evaluate(model, val_loader, device)
            if rank == 0:
                print(f"  val NDCG@10 {ndcg:.4f} HR@10 {hr:.4f}", flush=True)
                if ndcg > best:
                    best = ndcg
                    torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
