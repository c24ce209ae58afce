"""KvsAll DistMult for KGs whose entity table does not fit on one GPU.

One process drives all visible GPUs: the entity embedding table is cut into
row blocks, block i lives on cuda:i. Relations, the query and the loss stay on
cuda:0; scoring against all entities is done block by block on the device that
holds the block and the score columns are gathered back on cuda:0.

    python 07_distmult_sharded_table.py --data data/ogbl-wikikg2-tsv --dim 512
"""
import argparse
import logging
import math
import os
import time
from collections import defaultdict

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

log = logging.getLogger("sharded-distmult")


def cli():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--ckpt", default="ckpt/distmult_sharded.pt")
    ap.add_argument("--dim", type=int, default=400)
    ap.add_argument("--shards", type=int, default=0, help="0 = all visible GPUs")
    ap.add_argument("--batch_size", type=int, default=512)
    ap.add_argument("--lr", type=float, default=0.003)
    ap.add_argument("--label_smoothing", type=float, default=0.1)
    ap.add_argument("--dropout", type=float, default=0.2)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--eval_every", type=int, default=5)
    ap.add_argument("--resume", action="store_true")
    return ap.parse_args()


class ShardedEntityTable(nn.Module):
    def __init__(self, num_entities, dim, devices):
        super().__init__()
        self.devices = devices
        self.bounds = np.linspace(0, num_entities, len(devices) + 1).astype(np.int64).tolist()
        self.blocks = nn.ParameterList()
        for i, dev in enumerate(devices):
            rows = self.bounds[i + 1] - self.bounds[i]
            w = torch.empty(rows, dim, device=dev)
            nn.init.xavier_normal_(w)
            self.blocks.append(nn.Parameter(w))
        self.dim = dim

    def lookup(self, ids, out_device):
        out = torch.empty(ids.shape[0], self.dim, device=out_device)
        for i, (blk, dev) in enumerate(zip(self.blocks, self.devices)):
            lo, hi = self.bounds[i], self.bounds[i + 1]
            sel = ((ids >= lo) & (ids < hi)).nonzero(as_tuple=True)[0]
            if sel.numel() == 0:
                continue
            rows = blk[(ids[sel] - lo).to(dev)]
            out = out.index_put((sel,), rows.to(out_device))
        return out

    def score_all(self, q):
        # q: B x d on cuda:0 -> B x N on cuda:0
        cols = [(q.to(dev) @ blk.t()).to(q.device) for blk, dev in zip(self.blocks, self.devices)]
        return torch.cat(cols, dim=1)


class ShardedDistMult(nn.Module):
    def __init__(self, num_entities, num_relations, dim, dropout, devices):
        super().__init__()
        self.main = devices[0]
        self.entities = ShardedEntityTable(num_entities, dim, devices)
        self.relations = nn.Embedding(num_relations, dim).to(self.main)
        nn.init.xavier_normal_(self.relations.weight)
        self.bn = nn.BatchNorm1d(dim).to(self.main)
        self.drop = nn.Dropout(dropout)

    def forward(self, h, r):
        e = self.entities.lookup(h, self.main)
        q = self.drop(self.bn(e * self.relations(r)))
        return self.entities.score_all(q)


class KvsAll(Dataset):
    """One example per (head, relation) pair, the target is the set of all true tails."""

    def __init__(self, pairs_to_tails):
        self.keys = list(pairs_to_tails.keys())
        self.tails = [pairs_to_tails[k] for k in self.keys]

    def __len__(self):
        return len(self.keys)

    def __getitem__(self, i):
        return self.keys[i], self.tails[i]


def collate(batch):
    hr = torch.tensor([b[0] for b in batch], dtype=torch.long)
    rows = torch.cat([torch.full((len(b[1]),), i, dtype=torch.long) for i, b in enumerate(batch)])
    cols = torch.cat([torch.tensor(b[1], dtype=torch.long) for b in batch])
    return hr, rows, cols


def load(data):
    def vocab(fn):
        with open(os.path.join(data, fn)) as f:
            return {n: int(i) for i, n in (l.rstrip("\n").split("\t") for l in f)}

    ents, rels = vocab("entities.dict"), vocab("relations.dict")
    n_rel = len(rels)
    splits = {}
    for s in ("train", "valid", "test"):
        with open(os.path.join(data, f"{s}.txt")) as f:
            trip = [l.rstrip("\n").split("\t") for l in f]
        arr = np.array([(ents[h], rels[r], ents[t]) for h, r, t in trip], dtype=np.int64)
        inv = arr[:, [2, 1, 0]].copy()
        inv[:, 1] += n_rel  # reciprocal relation ids
        splits[s] = np.concatenate([arr, inv])
    return splits, len(ents), 2 * n_rel


@torch.no_grad()
def evaluate(model, triples, known, device, bs=256):
    model.eval()
    rr, h10, n = 0.0, 0, 0
    for i in range(0, len(triples), bs):
        b = torch.as_tensor(triples[i:i + bs], device=device)
        scores = model(b[:, 0], b[:, 1])
        gold = scores.gather(1, b[:, 2:3])
        for j, (h, r, _) in enumerate(b.tolist()):
            scores[j, known[(h, r)]] = -math.inf
        ranks = (scores > gold).sum(1) + 1
        rr += (1.0 / ranks.float()).sum().item()
        h10 += (ranks <= 10).sum().item()
        n += len(b)
    model.train()
    return rr / n, h10 / n


def main():
    args = cli()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    n_gpu = torch.cuda.device_count()
    shards = args.shards or n_gpu
    assert 1 <= shards <= n_gpu, f"asked for {shards} shards but only {n_gpu} GPUs are visible"
    devices = [torch.device(f"cuda:{i}") for i in range(shards)]
    main_dev = devices[0]

    splits, n_ent, n_rel = load(args.data)
    known = defaultdict(list)
    for h, r, t in np.concatenate(list(splits.values())).tolist():
        known[(h, r)].append(t)
    train_pairs = defaultdict(list)
    for h, r, t in splits["train"].tolist():
        train_pairs[(h, r)].append(t)
    loader = DataLoader(KvsAll(train_pairs), batch_size=args.batch_size, shuffle=True,
                        num_workers=4, collate_fn=collate, drop_last=False)
    log.info("%d entities over %d GPUs, %d relations (with inverses), %d (h, r) pairs",
             n_ent, shards, n_rel, len(train_pairs))

    model = ShardedDistMult(n_ent, n_rel, args.dim, args.dropout, devices)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    start, best = 0, 0.0
    if args.resume and os.path.exists(args.ckpt):
        state = torch.load(args.ckpt, map_location="cpu")
        model.load_state_dict(state["model"])  # copies each block back onto its own GPU
        opt.load_state_dict(state["opt"])
        start, best = state["epoch"] + 1, state["best"]

    for epoch in range(start, args.epochs):
        t0, total = time.time(), 0.0
        for hr, rows, cols in loader:
            hr = hr.to(main_dev)
            scores = model(hr[:, 0], hr[:, 1])
            target = torch.zeros_like(scores)
            target[rows.to(main_dev), cols.to(main_dev)] = 1.0
            target = (1 - args.label_smoothing) * target + args.label_smoothing / n_ent
            loss = F.binary_cross_entropy_with_logits(scores, target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.item()
        log.info("epoch %d loss %.5f %.0fs (max mem cuda:0 %.1f GiB)", epoch, total / len(loader),
                 time.time() - t0, torch.cuda.max_memory_allocated(main_dev) / 2 ** 30)

        if (epoch + 1) % args.eval_every == 0:
            mrr, h10 = evaluate(model, splits["valid"], known, main_dev)
            log.info("valid MRR %.4f Hits@10 %.4f", mrr, h10)
            if mrr > best:
                best = mrr
                os.makedirs(os.path.dirname(args.ckpt) or ".", exist_ok=True)
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                            "epoch": epoch, "best": best}, args.ckpt)

    if os.path.exists(args.ckpt):
        model.load_state_dict(torch.load(args.ckpt, map_location="cpu")["model"])
    mrr, h10 = evaluate(model, splits["test"], known, main_dev)
    log.info("test MRR %.4f Hits@10 %.4f", mrr, h10)


if __name__ == "__main__":
    main()
