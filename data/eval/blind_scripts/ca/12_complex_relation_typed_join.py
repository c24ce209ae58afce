"""ComplEx with relation-typed batches and uneven per-rank work.

Training triples are partitioned across ranks by relation (each rank owns a
set of relations, balanced greedily by triple count), and each rank only
forms batches from its own relations so that every batch is single-relation
and the per-relation negatives can be type-constrained. The partition cannot
be perfectly balanced, so ranks run different numbers of steps per epoch;
DDP's join() context shadows the missing all-reduces of the ranks that finish
first.

    torchrun --nproc_per_node=4 12_complex_relation_typed_join.py --data data/CoDEx-M
"""
import argparse
import heapq
import os
import random
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--batch_size", type=int, default=512)
    ap.add_argument("--neg", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--reg", type=float, default=5e-3)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--eval_every", type=int, default=10)
    ap.add_argument("--ckpt", default="ckpt/complex_typed.pt")
    ap.add_argument("--seed", type=int, default=11)
    return ap.parse_args()


def load_ids(d):
    ent = [l.rstrip("\n") for l in open(os.path.join(d, "entity_ids.txt"))]
    rel = [l.rstrip("\n") for l in open(os.path.join(d, "relation_ids.txt"))]
    e2i = {e: i for i, e in enumerate(ent)}
    r2i = {r: i for i, r in enumerate(rel)}

    def read(name):
        rows = [l.rstrip("\n").split("\t") for l in open(os.path.join(d, name))]
        return np.array([[e2i[h], r2i[r], e2i[t]] for h, r, t in rows], dtype=np.int64)

    return read("train.txt"), read("valid.txt"), read("test.txt"), len(ent), len(rel)


def partition_relations(train, world):
    # greedy bin packing: largest relation first onto the lightest rank
    counts = np.bincount(train[:, 1])
    heap = [(0, r) for r in range(world)]
    owner = {}
    for rel in np.argsort(-counts):
        if counts[rel] == 0:
            continue
        load, rk = heapq.heappop(heap)
        owner[int(rel)] = rk
        heapq.heappush(heap, (load + int(counts[rel]), rk))
    return owner


class ComplEx(nn.Module):
    def __init__(self, n_ent, n_rel, dim):
        super().__init__()
        self.dim = dim
        self.E = nn.Embedding(n_ent, 2 * dim)
        self.R = nn.Embedding(n_rel, 2 * dim)
        nn.init.normal_(self.E.weight, std=0.05)
        nn.init.normal_(self.R.weight, std=0.05)

    def _split(self, x):
        return x[..., :self.dim], x[..., self.dim:]

    def forward(self, h, r, t, neg_t):
        hr, hi = self._split(self.E(h))
        rr, ri = self._split(self.R(r))
        cand = torch.cat([t.unsqueeze(1), neg_t], dim=1)
        tr, ti = self._split(self.E(cand))
        qr = (hr * rr - hi * ri).unsqueeze(1)
        qi = (hr * ri + hi * rr).unsqueeze(1)
        logits = (qr * tr + qi * ti).sum(-1)
        labels = torch.zeros(h.size(0), dtype=torch.long, device=h.device)
        reg = (self.E(h).pow(2).sum(-1) + self.R(r).pow(2).sum(-1)
               + self.E(t).pow(2).sum(-1)).mean()
        return F.cross_entropy(logits, labels), reg

    @torch.no_grad()
    def all_scores(self, h, r):
        hr, hi = self._split(self.E(h))
        rr, ri = self._split(self.R(r))
        er, ei = self._split(self.E.weight)
        return (hr * rr - hi * ri) @ er.t() + (hr * ri + hi * rr) @ ei.t()


def relation_batches(my_triples, range_of, batch_size, neg, n_ent, rng):
    by_rel = defaultdict(list)
    for i, r in enumerate(my_triples[:, 1].tolist()):
        by_rel[r].append(i)
    batches = []
    for r, idx in by_rel.items():
        idx = np.array(idx)
        rng.shuffle(idx)
        for s in range(0, len(idx), batch_size):
            batches.append(idx[s:s + batch_size])
    rng.shuffle(batches)
    for idx in batches:
        b = my_triples[idx]
        cands = range_of[int(b[0, 1])]
        if len(cands) >= neg:
            n = cands[rng.integers(0, len(cands), size=(len(b), neg))]
        else:
            n = rng.integers(0, n_ent, size=(len(b), neg))
        yield torch.from_numpy(b), torch.from_numpy(n)


@torch.no_grad()
def evaluate(model, triples, filt, device, rank, world):
    model.eval()
    part = torch.from_numpy(triples[rank::world])
    agg = torch.zeros(4, dtype=torch.float64, device=device)
    for s in range(0, part.size(0), 256):
        b = part[s:s + 256].to(device)
        sc = model.all_scores(b[:, 0], b[:, 1])
        gold = sc.gather(1, b[:, 2:3]).clone()
        for i, (h, r, _) in enumerate(b.tolist()):
            sc[i, filt[(h, r)]] = float("-inf")
        sc.scatter_(1, b[:, 2:3], gold)
        rk = (sc > gold).sum(1).double() + 1
        agg[0] += (1 / rk).sum()
        agg[1] += (rk <= 1).sum()
        agg[2] += (rk <= 10).sum()
        agg[3] += rk.numel()
    dist.all_reduce(agg)
    model.train()
    return {"mrr": (agg[0] / agg[3]).item(), "hits@1": (agg[1] / agg[3]).item(),
            "hits@10": (agg[2] / agg[3]).item()}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train, valid, test, n_ent, n_rel = load_ids(args.data)
    recip = lambda x: np.concatenate([x, np.stack([x[:, 2], x[:, 1] + n_rel, x[:, 0]], 1)])
    train, valid, test = recip(train), recip(valid), recip(test)
    filt = defaultdict(list)
    for h, r, t in np.concatenate([train, valid, test]).tolist():
        filt[(h, r)].append(t)

    owner = partition_relations(train, world)
    my_triples = train[np.array([owner.get(int(r), -1) == rank for r in train[:, 1]])]
    range_of = defaultdict(list)
    for _, r, t in my_triples.tolist():
        range_of[r].append(t)
    range_of = {r: np.unique(np.array(v)) for r, v in range_of.items()}
    print(f"[rank {rank}] {len(my_triples)} training triples over "
          f"{sum(1 for v in owner.values() if v == rank)} relations", flush=True)

    torch.manual_seed(args.seed)
    model = ComplEx(n_ent, 2 * n_rel, args.dim).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(ddp.parameters(), lr=args.lr)
    rng = np.random.default_rng(args.seed + rank)

    best = -1.0
    for epoch in range(args.epochs):
        ddp.train()
        stats = torch.zeros(2, device=device)
        with ddp.join():
            for b, n in relation_batches(my_triples, range_of, args.batch_size, args.neg, n_ent, rng):
                b, n = b.to(device, non_blocking=True), n.to(device, non_blocking=True)
                loss, reg = ddp(b[:, 0], b[:, 1], b[:, 2], n)
                total = loss + args.reg * reg
                opt.zero_grad(set_to_none=True)
                total.backward()
                opt.step()
                stats[0] += loss.detach()
                stats[1] += 1
        dist.all_reduce(stats)
        if rank == 0:
            print(f"epoch {epoch}: loss {(stats[0] / stats[1]).item():.4f} "
                  f"({int(stats[1].item())} steps over all ranks)", flush=True)

        if (epoch + 1) % args.eval_every == 0:
            m = evaluate(model, valid, filt, device, rank, world)
            if rank == 0:
                print(f"  valid {m}", flush=True)
                if m["mrr"] > best:
                    best = m["mrr"]
                    os.makedirs(os.path.dirname(args.ckpt) or ".", exist_ok=True)
                    torch.save({"model": model.state_dict(), "epoch": epoch, "valid": m}, args.ckpt)
            dist.barrier()

    ck = torch.load(args.ckpt, map_location=device)
    model.load_state_dict(ck["model"])
    m = evaluate(model, test, filt, device, rank, world)
    if rank == 0:
        print(f"test (epoch {ck['epoch']}): {m}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
