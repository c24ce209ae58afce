"""RotatE training with relation-bucketed batches (one relation per batch).

Bucketing by relation lets us compute the relation rotation once per batch
and broadcast it over the whole batch, which is noticeably faster on
FB15k-237 / YAGO3-10 style graphs with a long tail of relations.

Launch:
    torchrun --nproc_per_node=4 01_rotate_relation_buckets.py --data data/FB15k-237
"""
import argparse
import logging
import math
import os
import random
import time
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

logger = logging.getLogger("rotate")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", type=str, required=True)
    p.add_argument("--dim", type=int, default=500)
    p.add_argument("--gamma", type=float, default=9.0)
    p.add_argument("--adv_temp", type=float, default=1.0)
    p.add_argument("--neg", type=int, default=256)
    p.add_argument("--batch_size", type=int, default=1024)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--eval_every", type=int, default=20)
    p.add_argument("--eval_batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=2024)
    p.add_argument("--out", type=str, default="runs/rotate_buckets")
    return p.parse_args()


def read_dict(path):
    d = {}
    with open(path) as f:
        for line in f:
            idx, name = line.strip().split("\t")
            d[name] = int(idx)
    return d


def read_triples(path, ent2id, rel2id):
    out = []
    with open(path) as f:
        for line in f:
            h, r, t = line.strip().split("\t")
            out.append((ent2id[h], rel2id[r], ent2id[t]))
    return np.array(out, dtype=np.int64)


class RotatE(nn.Module):
    def __init__(self, n_ent, n_rel, dim, gamma):
        super().__init__()
        self.dim = dim
        self.gamma = gamma
        self.eps = 2.0
        self.emb_range = (gamma + self.eps) / dim
        self.ent = nn.Parameter(torch.empty(n_ent, 2 * dim))
        self.rel = nn.Parameter(torch.empty(n_rel, dim))
        nn.init.uniform_(self.ent, -self.emb_range, self.emb_range)
        nn.init.uniform_(self.rel, -self.emb_range, self.emb_range)

    def _rotate(self, r_idx):
        phase = self.rel[r_idx] / (self.emb_range / math.pi)
        return torch.cos(phase), torch.sin(phase)

    def score(self, h, r_idx, t):
        # h: [B, 1 or N, 2d], t: [B, 1 or N, 2d], r_idx scalar or [B]
        re_h, im_h = h.chunk(2, dim=-1)
        re_t, im_t = t.chunk(2, dim=-1)
        re_r, im_r = self._rotate(r_idx)
        if re_r.dim() == 1:
            re_r, im_r = re_r.view(1, 1, -1), im_r.view(1, 1, -1)
        else:
            re_r, im_r = re_r.unsqueeze(1), im_r.unsqueeze(1)
        re = re_h * re_r - im_h * im_r - re_t
        im = re_h * im_r + im_h * re_r - im_t
        dist_ = torch.stack([re, im], dim=0).norm(dim=0).sum(dim=-1)
        return self.gamma - dist_

    def forward(self, heads, rel, tails, neg_tails, adv_temp):
        h = self.ent[heads].unsqueeze(1)
        t = self.ent[tails].unsqueeze(1)
        nt = self.ent[neg_tails]
        pos = self.score(h, rel, t).squeeze(1)
        neg = self.score(h, rel, nt)
        w = F.softmax(neg * adv_temp, dim=1).detach()
        neg_loss = -(w * F.logsigmoid(-neg)).sum(dim=1).mean()
        pos_loss = -F.logsigmoid(pos).mean()
        return (pos_loss + neg_loss) / 2

    @torch.no_grad()
    def score_all_tails(self, heads, rels):
        h = self.ent[heads].unsqueeze(1)
        allt = self.ent.unsqueeze(0)
        return self.score(h, rels, allt.expand(h.size(0), -1, -1))


def make_buckets(triples, batch_size, rng):
    by_rel = defaultdict(list)
    for i, r in enumerate(triples[:, 1]):
        by_rel[int(r)].append(i)
    batches = []
    for r, idx in by_rel.items():
        idx = np.array(idx)
        rng.shuffle(idx)
        for s in range(0, len(idx), batch_size):
            batches.append((r, idx[s:s + batch_size]))
    rng.shuffle(batches)
    return batches


@torch.no_grad()
def evaluate(model, triples, filt, n_ent, device, bs, rank, world):
    model.eval()
    shard = triples[rank::world]
    stats = torch.zeros(5, device=device, dtype=torch.float64)  # rr, h1, h3, h10, n
    for s in range(0, len(shard), bs):
        b = torch.from_numpy(shard[s:s + bs]).to(device)
        scores = model.score_all_tails(b[:, 0], b[:, 1])
        tgt = scores.gather(1, b[:, 2:3])
        for i, (h, r, t) in enumerate(shard[s:s + bs].tolist()):
            known = [x for x in filt[(h, r)] if x != t]
            if known:
                scores[i, known] = -float("inf")
        ranks = (scores > tgt).sum(dim=1) + 1
        stats[0] += (1.0 / ranks.double()).sum()
        stats[1] += (ranks <= 1).sum()
        stats[2] += (ranks <= 3).sum()
        stats[3] += (ranks <= 10).sum()
        stats[4] += ranks.numel()
    dist.all_reduce(stats)
    n = stats[4].item()
    model.train()
    return {"MRR": stats[0].item() / n, "H@1": stats[1].item() / n,
            "H@3": stats[2].item() / n, "H@10": stats[3].item() / n}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    torch.manual_seed(args.seed)
    ent2id = read_dict(os.path.join(args.data, "entities.dict"))
    rel2id = read_dict(os.path.join(args.data, "relations.dict"))
    train = read_triples(os.path.join(args.data, "train.txt"), ent2id, rel2id)
    valid = read_triples(os.path.join(args.data, "valid.txt"), ent2id, rel2id)
    test = read_triples(os.path.join(args.data, "test.txt"), ent2id, rel2id)
    n_ent, n_rel = len(ent2id), len(rel2id)

    # add reciprocal relations so tail prediction covers both directions
    def with_inverse(x):
        inv = np.stack([x[:, 2], x[:, 1] + n_rel, x[:, 0]], axis=1)
        return np.concatenate([x, inv], axis=0)

    train, valid, test = with_inverse(train), with_inverse(valid), with_inverse(test)
    filt = defaultdict(set)
    for h, r, t in np.concatenate([train, valid, test]).tolist():
        filt[(h, r)].add(t)

    model = RotatE(n_ent, 2 * n_rel, args.dim, args.gamma).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    os.makedirs(args.out, exist_ok=True)
    train_t = torch.from_numpy(train)
    best_mrr = 0.0
    for epoch in range(args.epochs):
        rng = np.random.default_rng(args.seed + epoch)
        batches = make_buckets(train, args.batch_size, rng)
        my_batches = batches[rank::world]
        t0, total = time.time(), 0.0
        for r, idx in my_batches:
            b = train_t[idx].to(device, non_blocking=True)
            neg = torch.randint(0, n_ent, (b.size(0), args.neg), device=device)
            loss = model(b[:, 0], r, b[:, 2], neg, args.adv_temp)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.item()
        logger.info("epoch %d  batches %d  loss %.4f  %.1fs", epoch, len(my_batches),
                    total / max(1, len(my_batches)), time.time() - t0)

        if (epoch + 1) % args.eval_every == 0:
            m = evaluate(model.module, valid, filt, n_ent, device, args.eval_batch, rank, world)
            logger.info("valid epoch %d %s", epoch, {k: round(v, 4) for k, v in m.items()})
            if rank == 0 and m["MRR"] > best_mrr:
                best_mrr = m["MRR"]
                torch.save({"model": model.module.state_dict(), "epoch": epoch,
                            "mrr": best_mrr}, os.path.join(args.out, "best.pt"))
            dist.barrier()

    ckpt = torch.load(os.path.join(args.out, "best.pt"), map_location=device)
    model.module.load_state_dict(ckpt["model"])
    m = evaluate(model.module, test, filt, n_ent, device, args.eval_batch, rank, world)
    logger.info("test (best epoch %d) %s", ckpt["epoch"], {k: round(v, 4) for k, v in m.items()})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
