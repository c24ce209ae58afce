#!/usr/bin/env python
"""Distributed TransE on FB15k-237 (raw tab-separated triples).

    torchrun --nproc_per_node=4 01_transe_fb15k237.py --data_dir data/FB15k-237
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

log = logging.getLogger("transe")


def get_args():
    p = argparse.ArgumentParser(description="TransE link prediction")
    p.add_argument("--data_dir", default="data/FB15k-237")
    p.add_argument("--out_dir", default="runs/transe_fb15k237")
    p.add_argument("--dim", type=int, default=200)
    p.add_argument("--margin", type=float, default=5.0)
    p.add_argument("--p_norm", type=int, default=1, choices=[1, 2])
    p.add_argument("--num_neg", type=int, default=64)
    p.add_argument("--batch_size", type=int, default=512, help="per GPU")
    p.add_argument("--eval_batch_size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--eval_every", type=int, default=25)
    p.add_argument("--num_workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


def load_split(path):
    with open(path) as f:
        return [tuple(line.rstrip("\n").split("\t")) for line in f if line.strip()]


def build_vocab(*splits):
    entities, relations = set(), set()
    for split in splits:
        for h, r, t in split:
            entities.update((h, t))
            relations.add(r)
    ent2id = {e: i for i, e in enumerate(entities)}
    rel2id = {r: i for i, r in enumerate(relations)}
    return ent2id, rel2id


def encode(split, ent2id, rel2id):
    return np.array([(ent2id[h], rel2id[r], ent2id[t]) for h, r, t in split], dtype=np.int64)


def build_filters(*arrays):
    tails, heads = defaultdict(set), defaultdict(set)
    for arr in arrays:
        for h, r, t in arr.tolist():
            tails[(h, r)].add(t)
            heads[(r, t)].add(h)
    to_t = lambda d: {k: torch.tensor(sorted(v), dtype=torch.long) for k, v in d.items()}
    return to_t(tails), to_t(heads)


class CorruptedTriples(Dataset):
    """Positive triple + `num_neg` uniformly corrupted heads or tails."""

    def __init__(self, triples, num_entities, num_neg):
        self.triples = torch.from_numpy(triples)
        self.num_entities = num_entities
        self.num_neg = num_neg

    def __len__(self):
        return self.triples.size(0)

    def __getitem__(self, idx):
        neg = torch.randint(0, self.num_entities, (self.num_neg,))
        corrupt_head = torch.rand(()) < 0.5
        return self.triples[idx], neg, corrupt_head


class TransE(nn.Module):
    def __init__(self, num_entities, num_relations, dim, p_norm):
        super().__init__()
        self.ent = nn.Embedding(num_entities, dim)
        self.rel = nn.Embedding(num_relations, dim)
        bound = 6.0 / dim ** 0.5
        nn.init.uniform_(self.ent.weight, -bound, bound)
        nn.init.uniform_(self.rel.weight, -bound, bound)
        with torch.no_grad():
            self.rel.weight.div_(self.rel.weight.norm(p=2, dim=1, keepdim=True))
        self.p_norm = p_norm

    def forward(self, pos, neg, corrupt_head):
        h, r, t = self.ent(pos[:, 0]), self.rel(pos[:, 1]), self.ent(pos[:, 2])
        pos_score = -torch.norm(h + r - t, p=self.p_norm, dim=-1)
        neg_e = self.ent(neg)
        mask = corrupt_head.view(-1, 1, 1)
        nh = torch.where(mask, neg_e, h.unsqueeze(1))
        nt = torch.where(mask, t.unsqueeze(1), neg_e)
        neg_score = -torch.norm(nh + r.unsqueeze(1) - nt, p=self.p_norm, dim=-1)
        return pos_score, neg_score

    @torch.no_grad()
    def normalize_entities(self):
        w = self.ent.weight
        w.div_(w.norm(p=2, dim=1, keepdim=True).clamp_min(1.0))

    @torch.no_grad()
    def score_tails(self, h, r):
        q = self.ent(h) + self.rel(r)
        return -torch.cdist(q, self.ent.weight, p=self.p_norm)

    @torch.no_grad()
    def score_heads(self, r, t):
        q = self.ent(t) - self.rel(r)
        return -torch.cdist(q, self.ent.weight, p=self.p_norm)


def filtered_ranks(scores, target, keys, filt):
    rows = torch.cat([torch.full((len(filt[k]),), i, dtype=torch.long) for i, k in enumerate(keys)])
    cols = torch.cat([filt[k] for k in keys])
    true = scores.gather(1, target.unsqueeze(1))
    scores = scores.index_put((rows.to(scores.device), cols.to(scores.device)),
                              torch.tensor(float("-inf"), device=scores.device))
    return 1 + (scores > true).sum(dim=1)


@torch.no_grad()
def evaluate(net, triples, filt_t, filt_h, device, rank, world, bs):
    shard = triples[rank::world]
    # sum of reciprocal ranks, hits@1, hits@3, hits@10, count
    stats = torch.zeros(5, dtype=torch.float64, device=device)
    for i in range(0, len(shard), bs):
        b = torch.from_numpy(shard[i:i + bs]).to(device)
        h, r, t = b[:, 0], b[:, 1], b[:, 2]
        hl, rl, tl = h.tolist(), r.tolist(), t.tolist()
        rk_t = filtered_ranks(net.score_tails(h, r), t, list(zip(hl, rl)), filt_t)
        rk_h = filtered_ranks(net.score_heads(r, t), h, list(zip(rl, tl)), filt_h)
        rk = torch.cat([rk_t, rk_h]).double()
        stats[0] += (1.0 / rk).sum()
        stats[1] += (rk <= 1).sum()
        stats[2] += (rk <= 3).sum()
        stats[3] += (rk <= 10).sum()
        stats[4] += rk.numel()
    dist.all_reduce(stats)
    n = stats[4].item()
    return {"mrr": stats[0].item() / n, "hits@1": stats[1].item() / n,
            "hits@3": stats[2].item() / n, "hits@10": stats[3].item() / n}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    train_raw = load_split(os.path.join(args.data_dir, "train.txt"))
    valid_raw = load_split(os.path.join(args.data_dir, "valid.txt"))
    test_raw = load_split(os.path.join(args.data_dir, "test.txt"))
    ent2id, rel2id = build_vocab(train_raw, valid_raw, test_raw)
    train = encode(train_raw, ent2id, rel2id)
    valid = encode(valid_raw, ent2id, rel2id)
    test = encode(test_raw, ent2id, rel2id)
    filt_t, filt_h = build_filters(train, valid, test)
    log.info("entities=%d relations=%d train=%d valid=%d test=%d world=%d",
             len(ent2id), len(rel2id), len(train), len(valid), len(test), world)

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "vocab.json"), "w") as f:
            json.dump({"entities": ent2id, "relations": rel2id}, f)

    ds = CorruptedTriples(train, len(ent2id), args.num_neg)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.num_workers, pin_memory=True, drop_last=True,
                        persistent_workers=True)

    model = TransE(len(ent2id), len(rel2id), args.dim, args.p_norm).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(ddp.parameters(), lr=args.lr)

    best_mrr = -1.0
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        ddp.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for pos, neg, ch in loader:
            pos = pos.to(device, non_blocking=True)
            neg = neg.to(device, non_blocking=True)
            ch = ch.to(device, non_blocking=True)
            model.normalize_entities()
            pos_s, neg_s = ddp(pos, neg, ch)
            loss = F.relu(args.margin - pos_s.unsqueeze(1) + neg_s).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum[0] += loss.detach()
            loss_sum[1] += 1
        dist.all_reduce(loss_sum)
        log.info("epoch %d loss %.4f (%.1fs)", epoch, (loss_sum[0] / loss_sum[1]).item(), time.time() - t0)

        if epoch % args.eval_every == 0 or epoch == args.epochs:
            model.eval()
            m = evaluate(model, valid, filt_t, filt_h, device, rank, world, args.eval_batch_size)
            log.info("epoch %d valid %s", epoch, json.dumps({k: round(v, 4) for k, v in m.items()}))
            if m["mrr"] > best_mrr:
                best_mrr = m["mrr"]
                if rank == 0:
                    torch.save({"epoch": epoch, "model": model.state_dict(),
                                "optimizer": opt.state_dict(), "valid": m},
                               os.path.join(args.out_dir, "best.pt"))
            dist.barrier()

    ckpt = torch.load(os.path.join(args.out_dir, "best.pt"), map_location=device)
    model.load_state_dict(ckpt["model"])
    model.eval()
    m = evaluate(model, test, filt_t, filt_h, device, rank, world, args.eval_batch_size)
    log.info("test (best epoch %d) %s", ckpt["epoch"], json.dumps({k: round(v, 4) for k, v in m.items()}))
    if rank == 0:
        with open(os.path.join(args.out_dir, "test_metrics.json"), "w") as f:
            json.dump(m, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
