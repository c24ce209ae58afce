"""SASRec with side information (item category) on Amazon Toys & Games.

Items are embedded as item-embedding + category-embedding. An optional auxiliary
head predicts the category of the next item (weight --aux_weight).

    torchrun --nproc_per_node=4 17_sasrec_category_aux.py --ratings data/toys/ratings.csv \
        --meta data/toys/item_category.tsv --out exp/toys_sasrec_cate
"""
import argparse
import csv
import math
import os
import random
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--ratings", required=True)
    p.add_argument("--meta", required=True, help="tsv: item_id <tab> leaf category")
    p.add_argument("--out", default="exp/toys_sasrec_cate")
    p.add_argument("--max_len", type=int, default=50)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.3)
    p.add_argument("--aux_weight", type=float, default=0.0)
    p.add_argument("--batch_size", type=int, default=128, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--eval_every", type=int, default=4)
    p.add_argument("--seed", type=int, default=2024)
    return p.parse_args()


def load(ratings_path, meta_path):
    cat_of = {}
    with open(meta_path) as f:
        for row in csv.reader(f, delimiter="\t"):
            cat_of[row[0]] = row[1]
    events = defaultdict(list)
    with open(ratings_path) as f:
        for item, user, _r, ts in csv.reader(f):
            if item in cat_of:
                events[user].append((int(ts), item))
    events = {u: sorted(v) for u, v in events.items() if len(v) >= 5}
    items = sorted({it for v in events.values() for _, it in v})
    item_id = {it: i + 1 for i, it in enumerate(items)}
    cats = sorted({cat_of[it] for it in items})
    cat_id = {c: i + 1 for i, c in enumerate(cats)}
    item2cat = [0] * (len(items) + 1)
    for it, i in item_id.items():
        item2cat[i] = cat_id[cat_of[it]]
    seqs = [[item_id[it] for _, it in events[u]] for u in sorted(events)]
    return seqs, len(items), len(cats), torch.tensor(item2cat)


class TrainData(Dataset):
    def __init__(self, seqs, n_items, max_len):
        self.seqs = [s[:-2] for s in seqs]
        self.n_items = n_items
        self.max_len = max_len

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        s = self.seqs[i]
        seen = set(s)
        x, pos = s[:-1][-self.max_len:], s[1:][-self.max_len:]
        neg = []
        for _ in pos:
            n = random.randint(1, self.n_items)
            while n in seen:
                n = random.randint(1, self.n_items)
            neg.append(n)
        pad = [0] * (self.max_len - len(x))
        return torch.tensor(pad + x), torch.tensor(pad + pos), torch.tensor(pad + neg)


class CateSASRec(nn.Module):
    def __init__(self, n_items, n_cats, item2cat, max_len, dim, blocks, heads, dropout):
        super().__init__()
        self.register_buffer("item2cat", item2cat, persistent=False)
        self.item_emb = nn.Embedding(n_items + 1, dim, padding_idx=0)
        self.cat_emb = nn.Embedding(n_cats + 1, dim, padding_idx=0)
        self.pos_emb = nn.Embedding(max_len, dim)
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(dim, heads, dim, dropout, batch_first=True, norm_first=True),
            blocks, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim, eps=1e-8)
        self.cate_head = nn.Linear(dim, n_cats + 1)

    def embed_items(self, ids):
        return self.item_emb(ids) + self.cat_emb(self.item2cat[ids])

    def encode(self, seq):
        L = seq.size(1)
        h = self.embed_items(seq) * math.sqrt(self.item_emb.embedding_dim) + self.pos_emb.weight[:L]
        h = self.drop(h) * (seq != 0).unsqueeze(-1)
        causal = torch.triu(torch.ones(L, L, dtype=torch.bool, device=seq.device), 1)
        return self.norm(self.encoder(h, mask=causal))

    def forward(self, seq, pos, neg, with_aux=False):
        h = self.encode(seq)
        pos_logits = (h * self.embed_items(pos)).sum(-1)
        neg_logits = (h * self.embed_items(neg)).sum(-1)
        cate_logits = self.cate_head(h) if with_aux else None
        return pos_logits, neg_logits, cate_logits


@torch.no_grad()
def evaluate(net, seqs, users, n_items, max_len, split, device, seed):
    net.eval()
    rnd = random.Random(seed)
    acc = torch.zeros(3, dtype=torch.float64, device=device)
    for b in range(0, len(users), 512):
        us = users[b:b + 512]
        X, C = [], []
        for u in us:
            s = seqs[u]
            hist, tgt = (s[:-2], s[-2]) if split == "valid" else (s[:-1], s[-1])
            hist = hist[-max_len:]
            X.append([0] * (max_len - len(hist)) + hist)
            seen = set(s)
            c = [tgt]
            while len(c) < 101:
                j = rnd.randint(1, n_items)
                if j not in seen:
                    c.append(j)
            C.append(c)
        X = torch.tensor(X, device=device)
        C = torch.tensor(C, device=device)
        h = net.encode(X)[:, -1:]
        sc = (net.embed_items(C) * h).sum(-1)
        r = (sc[:, 1:] > sc[:, :1]).sum(1).double()
        hit = (r < 10).double()
        acc[0] += hit.sum()
        acc[1] += (hit / torch.log2(r + 2)).sum()
        acc[2] += len(us)
    dist.all_reduce(acc)
    net.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    seqs, n_items, n_cats, item2cat = load(args.ratings, args.meta)
    if rank == 0:
        print(f"users {len(seqs)} items {n_items} categories {n_cats}", flush=True)
        os.makedirs(args.out, exist_ok=True)

    ds = TrainData(seqs, n_items, args.max_len)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=4, pin_memory=True)

    net = CateSASRec(n_items, n_cats, item2cat, args.max_len, args.dim, args.blocks, args.heads, args.dropout).to(device)
    model = DDP(net, device_ids=[local_rank])
    # reference setting: lr 1e-3 at 128 sequences per step
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * math.sqrt(world), betas=(0.9, 0.98))
    use_aux = args.aux_weight > 0

    users = list(range(rank, len(seqs), world))
    best = -1.0
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        t0 = time.time()
        meter = torch.zeros(3, device=device)
        for x, pos, neg in loader:
            x, pos, neg = x.to(device), pos.to(device), neg.to(device)
            pl, nl, cl = model(x, pos, neg, with_aux=use_aux)
            m = pos != 0
            rec_loss = F.binary_cross_entropy_with_logits(pl[m], torch.ones_like(pl[m])) + \
                F.binary_cross_entropy_with_logits(nl[m], torch.zeros_like(nl[m]))
            loss = rec_loss
            if use_aux:
                aux_loss = F.cross_entropy(cl[m], net.item2cat[pos[m]])
                loss = loss + args.aux_weight * aux_loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            meter += torch.stack([rec_loss.detach(), loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(meter)
        if rank == 0:
            print(f"epoch {epoch} rec {(meter[0] / meter[2]).item():.4f} total {(meter[1] / meter[2]).item():.4f} "
                  f"{time.time() - t0:.0f}s", flush=True)

        if epoch % args.eval_every == 0:
            hr, ndcg = evaluate(net, seqs, users, n_items, args.max_len, "valid", device, seed=epoch * 1000 + rank)
            if rank == 0:
                print(f"epoch {epoch} valid HR@10 {hr:.4f} NDCG@10 {ndcg:.4f}", flush=True)
                if ndcg > best:
                    best = ndcg
                    torch.save({"model": net.state_dict(), "epoch": epoch}, os.path.join(args.out, "best.pt"))
            dist.barrier()

    state = torch.load(os.path.join(args.out, "best.pt"), map_location=device)
    net.load_state_dict(state["model"])
    hr, ndcg = evaluate(net, seqs, users, n_items, args.max_len, "test", device, seed=99 + rank)
    if rank == 0:
        print(f"test HR@10 {hr:.4f} NDCG@10 {ndcg:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
