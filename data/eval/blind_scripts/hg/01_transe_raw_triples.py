#!/usr/bin/env python
"""TransE with margin ranking loss, data parallel over GPUs.

Reads raw triple files (head<TAB>relation<TAB>tail, one per line) so that
new dumps can be used without a separate preprocessing step.
"""
import argparse
import json
import logging
import os
import time
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("transe")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", required=True)
    p.add_argument("--output_dir", default="runs/transe")
    p.add_argument("--dim", type=int, default=200)
    p.add_argument("--margin", type=float, default=5.0)
    p.add_argument("--p_norm", type=int, default=1)
    p.add_argument("--num_neg", type=int, default=64)
    p.add_argument("--batch_size", type=int, default=1024, help="triples per GPU")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--eval_every", type=int, default=25)
    p.add_argument("--eval_batch_size", type=int, default=256)
    p.add_argument("--num_workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


def read_triples(path):
    with open(path, encoding="utf-8") as f:
        return [tuple(line.rstrip("\n").split("\t")) for line in f if line.strip()]


def load_kg(data_dir):
    splits = {s: read_triples(os.path.join(data_dir, f"{s}.txt")) for s in ("train", "valid", "test")}
    entities, relations = set(), set()
    for triples in splits.values():
        for h, r, t in triples:
            entities.add(h)
            entities.add(t)
            relations.add(r)
    ent2id = {e: i for i, e in enumerate(entities)}
    rel2id = {r: i for i, r in enumerate(relations)}
    encoded = {
        s: np.array([(ent2id[h], rel2id[r], ent2id[t]) for h, r, t in trip], dtype=np.int64)
        for s, trip in splits.items()
    }
    return encoded, ent2id, rel2id


class TripleDataset(Dataset):
    def __init__(self, triples):
        self.triples = triples

    def __len__(self):
        return len(self.triples)

    def __getitem__(self, idx):
        return self.triples[idx]


class UniformCorruption:
    """Collate fn: replaces head or tail of every positive with a random entity."""

    def __init__(self, num_entities, num_neg):
        self.num_entities = num_entities
        self.num_neg = num_neg

    def __call__(self, batch):
        pos = torch.as_tensor(np.stack(batch))
        b = pos.size(0)
        neg = pos.unsqueeze(1).repeat(1, self.num_neg, 1)
        rand_ent = torch.randint(0, self.num_entities, (b, self.num_neg))
        head_side = torch.rand(b, self.num_neg) < 0.5
        neg[..., 0] = torch.where(head_side, rand_ent, neg[..., 0])
        neg[..., 2] = torch.where(head_side, neg[..., 2], rand_ent)
        return pos, neg


class TransE(nn.Module):
    def __init__(self, num_entities, num_relations, dim, p_norm, margin):
        super().__init__()
        self.ent = nn.Embedding(num_entities, dim)
        self.rel = nn.Embedding(num_relations, dim)
        bound = 6.0 / dim ** 0.5
        nn.init.uniform_(self.ent.weight, -bound, bound)
        nn.init.uniform_(self.rel.weight, -bound, bound)
        with torch.no_grad():
            self.rel.weight.div_(self.rel.weight.norm(dim=1, keepdim=True))
        self.p_norm = p_norm
        self.margin = margin

    def score(self, h, r, t):
        return -(self.ent(h) + self.rel(r) - self.ent(t)).norm(p=self.p_norm, dim=-1)

    def forward(self, pos, neg):
        pos_score = self.score(pos[:, 0], pos[:, 1], pos[:, 2])
        neg_score = self.score(neg[..., 0], neg[..., 1], neg[..., 2])
        return F.relu(self.margin - pos_score.unsqueeze(1) + neg_score).mean()

    def score_tails(self, h, r):
        return -torch.cdist(self.ent(h) + self.rel(r), self.ent.weight, p=self.p_norm)

    def score_heads(self, r, t):
        return -torch.cdist(self.ent(t) - self.rel(r), self.ent.weight, p=self.p_norm)


def build_filters(splits):
    tails, heads = defaultdict(list), defaultdict(list)
    for triples in splits.values():
        for h, r, t in triples.tolist():
            tails[(h, r)].append(t)
            heads[(r, t)].append(h)
    return tails, heads


@torch.no_grad()
def evaluate(model, triples, filters, device, batch_size, rank, world_size):
    """Filtered MRR / Hits@k, each rank ranks a strided slice, sums are all-reduced."""
    model.eval()
    tails, heads = filters
    shard = triples[rank::world_size]
    # sum of reciprocal ranks, hits@1, hits@3, hits@10, number of ranked queries
    stats = torch.zeros(5, device=device, dtype=torch.float64)
    for start in range(0, len(shard), batch_size):
        batch = torch.as_tensor(shard[start:start + batch_size], device=device)
        h, r, t = batch[:, 0], batch[:, 1], batch[:, 2]
        rows = batch.tolist()
        for side in ("tail", "head"):
            if side == "tail":
                scores, target = model.score_tails(h, r), t
                known = [tails[(a, b)] for a, b, _ in rows]
            else:
                scores, target = model.score_heads(r, t), h
                known = [heads[(b, c)] for _, b, c in rows]
            target_score = scores.gather(1, target[:, None])
            for i, ids in enumerate(known):
                scores[i, ids] = float("-inf")
            ranks = (scores > target_score).sum(dim=1).double() + 1.0
            stats[0] += (1.0 / ranks).sum()
            stats[1] += (ranks <= 1).sum()
            stats[2] += (ranks <= 3).sum()
            stats[3] += (ranks <= 10).sum()
            stats[4] += ranks.numel()
    dist.all_reduce(stats)
    n = stats[4].item()
    model.train()
    return {"mrr": stats[0].item() / n, "hits@1": stats[1].item() / n,
            "hits@3": stats[2].item() / n, "hits@10": stats[3].item() / n}


def main():
    args = parse_args()
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [%(levelname)s] %(message)s")
    torch.manual_seed(args.seed)

    splits, ent2id, rel2id = load_kg(args.data_dir)
    filters = build_filters(splits)
    logger.info("entities=%d relations=%d train=%d valid=%d test=%d", len(ent2id), len(rel2id),
                len(splits["train"]), len(splits["valid"]), len(splits["test"]))

    train_set = TripleDataset(splits["train"])
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.num_workers, pin_memory=True, drop_last=True,
                        collate_fn=UniformCorruption(len(ent2id), args.num_neg))

    model = TransE(len(ent2id), len(rel2id), args.dim, args.p_norm, args.margin).to(device)
    model = DDP(model, device_ids=[local_rank])
    torch.manual_seed(args.seed + rank)  # negatives differ per rank
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "vocab.json"), "w") as f:
            json.dump({"entities": ent2id, "relations": rel2id}, f)

    best_mrr = 0.0
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        t0 = time.time()
        total, steps = 0.0, 0
        for pos, neg in loader:
            pos = pos.to(device, non_blocking=True)
            neg = neg.to(device, non_blocking=True)
            loss = model(pos, neg)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.item()
            steps += 1
        logger.info("epoch %d loss %.4f (%.1fs)", epoch, total / max(steps, 1), time.time() - t0)

        if epoch % args.eval_every == 0 or epoch == args.epochs:
            metrics = evaluate(model.module, splits["valid"], filters, device,
                               args.eval_batch_size, rank, world_size)
            logger.info("valid epoch %d: %s", epoch, json.dumps(metrics))
            if rank == 0 and metrics["mrr"] > best_mrr:
                best_mrr = metrics["mrr"]
                torch.save({"epoch": epoch, "model": model.module.state_dict(),
                            "optimizer": optimizer.state_dict(), "args": vars(args)},
                           os.path.join(args.output_dir, "best.pt"))
            dist.barrier()

    ckpt = torch.load(os.path.join(args.output_dir, "best.pt"), map_location=device)
    model.module.load_state_dict(ckpt["model"])
    test_metrics = evaluate(model.module, splits["test"], filters, device,
                            args.eval_batch_size, rank, world_size)
    logger.info("test (best epoch %d): %s", ckpt["epoch"], json.dumps(test_metrics))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
