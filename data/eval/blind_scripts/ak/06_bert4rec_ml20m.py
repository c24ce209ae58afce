#!/usr/bin/env python
"""BERT4Rec on MovieLens-20M, distributed data parallel.

Cloze objective: a fraction of the items in each sequence is replaced by [MASK]
and predicted over the full item vocabulary. Evaluation follows the paper:
the held-out last item ranked against 100 popularity-sampled negatives.

    torchrun --nproc_per_node=8 06_bert4rec_ml20m.py --data data/ml-20m/ratings.csv \
        --epochs 100 --batch-size 64
"""
import argparse
import math
import os
import random

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def args_():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--max-len", type=int, default=200)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--mask-prob", type=float, default=0.2)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--warmup-steps", type=int, default=2000)
    p.add_argument("--logdir", default="runs/bert4rec_ml20m")
    p.add_argument("--seed", type=int, default=98765)
    return p.parse_args()


def build_sequences(path):
    df = pd.read_csv(path)
    df = df[df.rating >= 4]
    # integer movieIds: sorted unique gives the same mapping everywhere
    smap = {m: i + 1 for i, m in enumerate(sorted(df.movieId.unique()))}
    df = df.sort_values(["userId", "timestamp"], kind="mergesort")
    seqs = df.groupby("userId").movieId.apply(lambda s: [smap[m] for m in s]).tolist()
    seqs = [s for s in seqs if len(s) >= 5]
    counts = np.bincount(np.concatenate(seqs), minlength=len(smap) + 1).astype(np.float64)
    counts[0] = 0
    return seqs, len(smap), counts / counts.sum()


class ClozeTrain(Dataset):
    def __init__(self, seqs, num_items, max_len, mask_prob):
        self.seqs = [s[:-1] for s in seqs]  # last item held out for test
        self.num_items = num_items
        self.mask_token = num_items + 1
        self.max_len = max_len
        self.mask_prob = mask_prob

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        s = self.seqs[i][-self.max_len:]
        tokens, labels = [], []
        for it in s:
            p = random.random()
            if p < self.mask_prob:
                p /= self.mask_prob
                if p < 0.8:
                    tokens.append(self.mask_token)
                elif p < 0.9:
                    tokens.append(random.randint(1, self.num_items))
                else:
                    tokens.append(it)
                labels.append(it)
            else:
                tokens.append(it)
                labels.append(0)
        pad = self.max_len - len(tokens)
        return torch.LongTensor([0] * pad + tokens), torch.LongTensor([0] * pad + labels)


class ClozeEval(Dataset):
    def __init__(self, seqs, num_items, max_len, pop, n_neg=100, seed=0):
        self.seqs, self.max_len = seqs, max_len
        self.mask_token = num_items + 1
        rng = np.random.default_rng(seed)
        self.negs = []
        for s in seqs:
            seen = set(s)
            negs = []
            while len(negs) < n_neg:
                cand = rng.choice(len(pop), size=2 * n_neg, replace=False, p=pop)
                negs += [int(c) for c in cand if c not in seen and c not in negs]
            self.negs.append(negs[:n_neg])

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        s = self.seqs[i]
        hist = (s[:-1] + [self.mask_token])[-self.max_len:]
        hist = [0] * (self.max_len - len(hist)) + hist
        return torch.LongTensor(hist), torch.LongTensor([s[-1]] + self.negs[i])


class BERT4Rec(nn.Module):
    def __init__(self, num_items, max_len, hidden, layers, heads, dropout):
        super().__init__()
        self.tok = nn.Embedding(num_items + 2, hidden, padding_idx=0)
        self.pos = nn.Embedding(max_len, hidden)
        self.ln = nn.LayerNorm(hidden)
        self.drop = nn.Dropout(dropout)
        enc = nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, dropout,
                                         activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(enc, layers)
        self.out = nn.Linear(hidden, num_items + 1)

    def forward(self, x):
        pos = torch.arange(x.size(1), device=x.device)
        h = self.drop(self.ln(self.tok(x) + self.pos(pos)))
        h = self.encoder(h, src_key_padding_mask=(x == 0))
        return self.out(h)


def worker_init(worker_id):
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    m = torch.zeros(4, device=device)  # ndcg@10, hr@10, mrr, n
    for x, cands in loader:
        x, cands = x.to(device), cands.to(device)
        logits = model(x)[:, -1]
        scores = logits.gather(1, cands)
        r = (scores > scores[:, :1]).sum(1).float()
        m[0] += ((r < 10).float() / torch.log2(r + 2)).sum()
        m[1] += (r < 10).float().sum()
        m[2] += (1.0 / (r + 1)).sum()
        m[3] += x.size(0)
    dist.all_reduce(m)
    model.train()
    return (m[:3] / m[3]).tolist()


def main():
    args = args_()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    random.seed(args.seed + rank)

    seqs, num_items, pop = build_sequences(args.data)
    train_ds = ClozeTrain(seqs, num_items, args.max_len, args.mask_prob)
    test_ds = ClozeEval(seqs, num_items, args.max_len, pop, seed=args.seed)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, worker_init_fn=worker_init, drop_last=True,
                              pin_memory=True)
    # strided shard of the users, no padding duplicates in the metrics
    test_shard = torch.utils.data.Subset(test_ds, range(rank, len(test_ds), dist.get_world_size()))
    test_loader = DataLoader(test_shard, batch_size=256, num_workers=2)

    model = BERT4Rec(num_items, args.max_len, args.hidden, args.layers, args.heads,
                     args.dropout).to(device)
    model = DDP(model, device_ids=[local_rank])
    no_decay = [p for n, p in model.named_parameters() if p.ndim == 1 or "norm" in n or n.endswith("ln.weight")]
    decay = [p for n, p in model.named_parameters() if not (p.ndim == 1 or "norm" in n or n.endswith("ln.weight"))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr)
    total_steps = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / args.warmup_steps,
                           0.5 * (1 + math.cos(math.pi * s / total_steps))))

    writer = SummaryWriter(args.logdir) if rank == 0 else None
    step = 0
    for epoch in range(args.epochs):
        model.train()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            step += 1
            if writer is not None and step % 100 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/lr", sched.get_last_lr()[0], step)

        if (epoch + 1) % 5 == 0:
            ndcg, hr, mrr = evaluate(model, test_loader, device)
            if rank == 0:
                print(f"epoch {epoch + 1}: NDCG@10 {ndcg:.4f} HR@10 {hr:.4f} MRR {mrr:.4f}", flush=True)
                writer.add_scalar("test/ndcg10", ndcg, step)
                writer.add_scalar("test/hr10", hr, step)
                torch.save({"model": model.module.state_dict(), "epoch": epoch},
                           os.path.join(args.logdir, "model.pt"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
