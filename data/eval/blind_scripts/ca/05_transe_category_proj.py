"""TransE with relation-category projections.

Relations are bucketed into the four mapping categories of Bordes et al.
(1-1, 1-N, N-1, N-N) from their tails-per-head / heads-per-tail stats.
Each category has its own linear projection of the entity space, and every
training batch is drawn from a single category so the projection is applied
once per batch.

    torchrun --nproc_per_node=4 05_transe_category_proj.py --data data/FB15k
"""
import argparse
import os
import random
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

CATEGORIES = ("1-1", "1-N", "N-1", "N-N")


def read_split(path, e2i, r2i):
    trip = []
    for line in open(path):
        h, r, t = line.split()
        trip.append((e2i[h], r2i[r], e2i[t]))
    return np.asarray(trip, dtype=np.int64)


def read_map(path):
    m = {}
    for line in open(path):
        name, idx = line.split()
        m[name] = int(idx)
    return m


def relation_categories(train, n_rel):
    tph = defaultdict(lambda: defaultdict(set))
    hpt = defaultdict(lambda: defaultdict(set))
    for h, r, t in train:
        tph[r][h].add(t)
        hpt[r][t].add(h)
    cat = np.zeros(n_rel, dtype=np.int64)
    for r in range(n_rel):
        a = np.mean([len(v) for v in tph[r].values()]) if tph[r] else 1.0
        b = np.mean([len(v) for v in hpt[r].values()]) if hpt[r] else 1.0
        cat[r] = (2 if b >= 1.5 else 0) + (1 if a >= 1.5 else 0)
    return cat


class CategoryTransE(nn.Module):
    def __init__(self, n_ent, n_rel, dim, margin):
        super().__init__()
        self.ent = nn.Embedding(n_ent, dim)
        self.rel = nn.Embedding(n_rel, dim)
        self.proj = nn.ModuleList([nn.Linear(dim, dim, bias=False) for _ in CATEGORIES])
        for p in self.proj:
            nn.init.eye_(p.weight)
        nn.init.xavier_uniform_(self.ent.weight)
        nn.init.xavier_uniform_(self.rel.weight)
        self.margin = margin

    def energy(self, h, r, t, cat):
        P = self.proj[cat]
        return (P(h) + r - P(t)).norm(p=1, dim=-1)

    def forward(self, pos, neg, cat):
        e_pos = self.energy(self.ent(pos[:, 0]), self.rel(pos[:, 1]), self.ent(pos[:, 2]), cat)
        e_neg = self.energy(self.ent(neg[:, 0]), self.rel(neg[:, 1]), self.ent(neg[:, 2]), cat)
        return F.relu(self.margin + e_pos - e_neg).mean()

    @torch.no_grad()
    def tail_scores(self, h, r, cat):
        # cat is per-example here; loop over the four projections
        out = torch.empty(h.size(0), self.ent.num_embeddings, device=h.device)
        for c in range(len(CATEGORIES)):
            m = cat == c
            if m.any():
                P = self.proj[c]
                q = P(self.ent(h[m])) + self.rel(r[m])
                out[m] = -torch.cdist(q, P(self.ent.weight), p=1)
        return out


def corrupt(batch, n_ent, gen):
    neg = batch.clone()
    mask = torch.rand(batch.size(0), generator=gen, device=batch.device) < 0.5
    rnd = torch.randint(n_ent, (batch.size(0),), generator=gen, device=batch.device)
    neg[mask, 0] = rnd[mask]
    neg[~mask, 2] = rnd[~mask]
    return neg


@torch.no_grad()
def filtered_eval(model, triples, rel_cat, known, device, rank, world, bs=256):
    part = triples[rank::world]
    tot = torch.zeros(4, dtype=torch.float64, device=device)
    for s in range(0, len(part), bs):
        b = torch.as_tensor(part[s:s + bs], device=device)
        sc = model.tail_scores(b[:, 0], b[:, 1], rel_cat[b[:, 1]])
        rows = torch.arange(len(b), device=device)
        tgt = sc[rows, b[:, 2]].clone()
        for i, (h, r, t) in enumerate(part[s:s + bs].tolist()):
            sc[i, list(known[(h, r)])] = -float("inf")
        sc[rows, b[:, 2]] = tgt
        rk = (sc > tgt[:, None]).sum(1).double() + 1
        tot[0] += (1 / rk).sum()
        tot[1] += (rk <= 3).sum()
        tot[2] += (rk <= 10).sum()
        tot[3] += rk.numel()
    dist.all_reduce(tot)
    return {"mrr": (tot[0] / tot[3]).item(), "hits@3": (tot[1] / tot[3]).item(),
            "hits@10": (tot[2] / tot[3]).item()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/FB15k")
    ap.add_argument("--dim", type=int, default=100)
    ap.add_argument("--margin", type=float, default=2.0)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--batch_size", type=int, default=2048)
    ap.add_argument("--steps_per_epoch", type=int, default=300)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--out", default="out/cat_transe")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    e2i = read_map(os.path.join(args.data, "entity2id.txt"))
    r2i = read_map(os.path.join(args.data, "relation2id.txt"))
    train = read_split(os.path.join(args.data, "train.txt"), e2i, r2i)
    valid = read_split(os.path.join(args.data, "valid.txt"), e2i, r2i)
    test = read_split(os.path.join(args.data, "test.txt"), e2i, r2i)
    n_ent, n_rel = len(e2i), len(r2i)

    cat_np = relation_categories(train, n_rel)
    rel_cat = torch.from_numpy(cat_np).to(dev)
    by_cat = [torch.from_numpy(train[cat_np[train[:, 1]] == c]).to(dev)
              for c in range(len(CATEGORIES))]
    cat_sizes = np.array([len(x) for x in by_cat], dtype=np.float64)
    known = defaultdict(set)
    for h, r, t in np.concatenate([train, valid, test]).tolist():
        known[(h, r)].add(t)

    torch.manual_seed(args.seed)
    model = CategoryTransE(n_ent, n_rel, args.dim, args.margin).to(dev)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    # same category schedule on every rank, different triples per rank
    cat_rng = random.Random(args.seed)
    gen = torch.Generator(device=dev).manual_seed(args.seed * 1000 + rank)
    best = 0.0
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        model.train()
        losses = []
        for step in range(args.steps_per_epoch):
            c = cat_rng.choices(range(len(CATEGORIES)), weights=cat_sizes)[0]
            pool = by_cat[c]
            idx = torch.randint(len(pool), (args.batch_size,), generator=gen, device=dev)
            pos = pool[idx]
            neg = corrupt(pos, n_ent, gen)
            loss = model(pos, neg, c)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        mean_loss = torch.stack(losses).mean()
        dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
        if rank == 0:
            print(f"epoch {epoch} loss {mean_loss.item():.4f}", flush=True)

        if (epoch + 1) % 10 == 0:
            model.eval()
            res = filtered_eval(model.module, valid, rel_cat, known, dev, rank, world)
            if rank == 0:
                print(f"valid {res}", flush=True)
                if res["mrr"] > best:
                    best = res["mrr"]
                    torch.save({"model": model.module.state_dict(), "epoch": epoch,
                                "rel_cat": cat_np}, os.path.join(args.out, "best.pt"))
            dist.barrier()

    ck = torch.load(os.path.join(args.out, "best.pt"), map_location=dev, weights_only=False)
    model.module.load_state_dict(ck["model"])
    res = filtered_eval(model.module, test, rel_cat, known, dev, rank, world)
    if rank == 0:
        print(f"test {res}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
