#!/usr/bin/env python
"""RESCAL (Nickel et al. 2011) with 1-N scoring, trained with DDP.

Evaluation collects every individual rank from all GPUs so we can report
mean / median rank and a per-relation-category breakdown (1-1, 1-N, N-1, N-N).

    torchrun --nproc_per_node=4 14_rescal_gather_ranks.py --data data/FB15k-237 --out runs/rescal
"""
import argparse
import json
import os
import time
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def args_():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/rescal")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch_size", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--wd", type=float, default=0.0)
    p.add_argument("--label_smoothing", type=float, default=0.1)
    p.add_argument("--entity_dropout", type=float, default=0.2)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--eval_every", type=int, default=20)
    return p.parse_args()


def load(data):
    def vocab(fn):
        with open(os.path.join(data, fn)) as f:
            return {n: int(i) for i, n in (l.rstrip("\n").split("\t") for l in f)}

    e, r = vocab("entities.dict"), vocab("relations.dict")
    splits = {}
    for s in ("train", "valid", "test"):
        with open(os.path.join(data, f"{s}.txt")) as f:
            splits[s] = torch.tensor([[e[a], r[b], e[c]] for a, b, c in (l.rstrip("\n").split("\t") for l in f)])
    return splits, len(e), len(r)


def relation_categories(train, n_rel):
    """Bordes et al. 2013: tph/hpt >= 1.5 means the N side."""
    tails, heads = defaultdict(set), defaultdict(set)
    for h, r, t in train.tolist():
        tails[(r, h)].add(t)
        heads[(r, t)].add(h)
    tph, hpt = np.zeros(n_rel), np.zeros(n_rel)
    nh, nt = np.zeros(n_rel), np.zeros(n_rel)
    for (r, _), s in tails.items():
        tph[r] += len(s); nh[r] += 1
    for (r, _), s in heads.items():
        hpt[r] += len(s); nt[r] += 1
    tph, hpt = tph / np.maximum(nh, 1), hpt / np.maximum(nt, 1)
    cat = np.zeros(n_rel, dtype=np.int64)          # 0:1-1 1:1-N 2:N-1 3:N-N
    cat[(tph >= 1.5) & (hpt < 1.5)] = 1
    cat[(tph < 1.5) & (hpt >= 1.5)] = 2
    cat[(tph >= 1.5) & (hpt >= 1.5)] = 3
    return torch.from_numpy(cat)


class RESCAL(nn.Module):
    def __init__(self, n_ent, n_rel, dim, dropout):
        super().__init__()
        self.dim = dim
        self.E = nn.Embedding(n_ent, dim)
        self.W = nn.Embedding(n_rel, dim * dim)
        nn.init.xavier_normal_(self.E.weight)
        nn.init.xavier_normal_(self.W.weight.view(n_rel, dim, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, h, r):
        """h^T W_r E^T -> scores of (h, r, ?) for every entity."""
        q = torch.bmm(self.drop(self.E(h)).unsqueeze(1), self.W(r).view(-1, self.dim, self.dim)).squeeze(1)
        return q @ self.E.weight.t()

    def forward_inv(self, r, t):
        q = torch.bmm(self.W(r).view(-1, self.dim, self.dim), self.E(t).unsqueeze(2)).squeeze(2)
        return q @ self.E.weight.t()


@torch.no_grad()
def compute_ranks(model, triples, filt_t, filt_h, device, bs=256):
    ranks = []
    for i in range(0, len(triples), bs):
        b = triples[i:i + bs].to(device)
        for tail in (True, False):
            s = model(b[:, 0], b[:, 1]) if tail else model.forward_inv(b[:, 1], b[:, 2])
            gold_ids = b[:, 2] if tail else b[:, 0]
            gold = s.gather(1, gold_ids[:, None])
            for j, (h, r, t) in enumerate(b.tolist()):
                s[j, filt_t[(h, r)] if tail else filt_h[(r, t)]] = -float("inf")
            ranks.append(torch.stack([(s > gold).sum(1) + 1, b[:, 1], torch.full_like(b[:, 1], int(tail))], 1))
    return torch.cat(ranks)


def evaluate(model, triples, filt_t, filt_h, rel_cat, device, rank, world):
    model.eval()
    local = compute_ranks(model, triples[rank::world], filt_t, filt_h, device)
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    model.train()
    allr = torch.cat(gathered).cpu()
    rk = allr[:, 0].double()
    res = {"MRR": (1 / rk).mean().item(), "MR": rk.mean().item(), "median": rk.median().item(),
           "H@1": (rk <= 1).double().mean().item(), "H@10": (rk <= 10).double().mean().item()}
    cats = rel_cat[allr[:, 1]]
    for c, name in enumerate(["1-1", "1-N", "N-1", "N-N"]):
        for side, sname in ((1, "tail"), (0, "head")):
            m = (cats == c) & (allr[:, 2] == side)
            if m.any():
                res[f"H@10/{name}/{sname}"] = (rk[m] <= 10).double().mean().item()
    return res


def main():
    a = args_()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)

    splits, n_ent, n_rel = load(a.data)
    rel_cat = relation_categories(splits["train"], n_rel)
    filt_t, filt_h = defaultdict(list), defaultdict(list)
    for h, r, t in torch.cat(list(splits.values())).tolist():
        filt_t[(h, r)].append(t)
        filt_h[(r, t)].append(h)
    # 1-N training examples: every (h, r) pair with all its train tails
    hr_tails = defaultdict(list)
    for h, r, t in splits["train"].tolist():
        hr_tails[(h, r)].append(t)
    keys = torch.tensor(list(hr_tails.keys()))
    targets = [hr_tails[tuple(k)] for k in keys.tolist()]

    ds = TensorDataset(keys, torch.arange(len(keys)))
    sampler = DistributedSampler(ds, shuffle=True)
    loader = DataLoader(ds, batch_size=a.batch_size, sampler=sampler, drop_last=True)

    model = RESCAL(n_ent, n_rel, a.dim, a.entity_dropout).to(dev)
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(ddp.parameters(), lr=a.lr, weight_decay=a.wd)
    if rank == 0:
        os.makedirs(a.out, exist_ok=True)
        print(f"{n_ent} entities, {n_rel} relations, {len(keys)} (h,r) pairs, world={world}", flush=True)

    best = 0.0
    for ep in range(a.epochs):
        sampler.set_epoch(ep)
        t0, tot = time.time(), 0.0
        for hr, idx in loader:
            hr = hr.to(dev)
            y = torch.zeros(len(hr), n_ent, device=dev)
            rows = torch.cat([torch.full((len(targets[i]),), j) for j, i in enumerate(idx.tolist())])
            cols = torch.cat([torch.tensor(targets[i]) for i in idx.tolist()])
            y[rows.to(dev), cols.to(dev)] = 1.0
            y = y * (1 - a.label_smoothing) + a.label_smoothing / n_ent
            loss = F.binary_cross_entropy_with_logits(ddp(hr[:, 0], hr[:, 1]), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            tot += loss.item()
        if rank == 0:
            print(f"ep {ep} loss {tot / len(loader):.5f} {time.time() - t0:.0f}s", flush=True)

        if (ep + 1) % a.eval_every == 0:
            res = evaluate(model, splits["valid"], filt_t, filt_h, rel_cat, dev, rank, world)
            if rank == 0:
                print("valid", json.dumps(res), flush=True)
                if res["MRR"] > best:
                    best = res["MRR"]
                    torch.save({"model": model.state_dict(), "epoch": ep}, os.path.join(a.out, "best.pt"))
            dist.barrier()

    model.load_state_dict(torch.load(os.path.join(a.out, "best.pt"), map_location=dev)["model"])
    res = evaluate(model, splits["test"], filt_t, filt_h, rel_cat, dev, rank, world)
    if rank == 0:
        print("test", json.dumps(res), flush=True)
        with open(os.path.join(a.out, "test_metrics.json"), "w") as f:
            json.dump(res, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
