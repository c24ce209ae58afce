"""Holographic embeddings (HolE) for link prediction on CoDEx-M, distributed data parallel.

Usage:
    torchrun --nproc_per_node=4 10_hole_codex.py --data data/codex-m --epochs 200
"""
import argparse
import json
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def build_parser():
    parser = argparse.ArgumentParser(description="HolE")
    parser.add_argument("--data", type=str, default="data/codex-m")
    parser.add_argument("--output", type=str, default="output/hole_codexm")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--num_negs", type=int, default=100)
    parser.add_argument("--batch_size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--wd", type=float, default=1e-6)
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--valid_every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class CodexData:
    def __init__(self, root):
        with open(os.path.join(root, "entity_ids.json")) as f:
            self.e2id = json.load(f)
        with open(os.path.join(root, "relation_ids.json")) as f:
            self.r2id = json.load(f)
        self.split = {}
        for name in ("train", "valid", "test"):
            with open(os.path.join(root, f"{name}.txt")) as f:
                rows = [l.split() for l in f if l.strip()]
            self.split[name] = torch.tensor([[self.e2id[h], self.r2id[r], self.e2id[t]] for h, r, t in rows])
        self.num_ent, self.num_rel = len(self.e2id), len(self.r2id)
        self.true_tails, self.true_heads = {}, {}
        for h, r, t in torch.cat(list(self.split.values())).tolist():
            self.true_tails.setdefault((h, r), set()).add(t)
            self.true_heads.setdefault((r, t), set()).add(h)


class NegativeSampler(Dataset):
    def __init__(self, triples, num_ent, num_negs):
        self.triples, self.num_ent, self.num_negs = triples, num_ent, num_negs

    def __len__(self):
        return self.triples.size(0)

    def __getitem__(self, idx):
        triple = self.triples[idx]
        negs = triple.repeat(self.num_negs, 1)
        corrupt = torch.randint(self.num_ent, (self.num_negs,))
        side = torch.randint(2, (self.num_negs,)) * 2  # column 0 (head) or 2 (tail)
        negs[torch.arange(self.num_negs), side] = corrupt
        return triple, negs


def circular_correlation(a, b):
    return torch.fft.irfft(torch.conj(torch.fft.rfft(a, dim=-1)) * torch.fft.rfft(b, dim=-1), n=a.size(-1), dim=-1)


class HolE(nn.Module):
    def __init__(self, num_ent, num_rel, dim):
        super().__init__()
        self.ent = nn.Embedding(num_ent, dim)
        self.rel = nn.Embedding(num_rel, dim)
        nn.init.xavier_uniform_(self.ent.weight)
        nn.init.xavier_uniform_(self.rel.weight)

    def score(self, triples):
        h, r, t = self.ent(triples[..., 0]), self.rel(triples[..., 1]), self.ent(triples[..., 2])
        return (r * circular_correlation(h, t)).sum(-1)

    def forward(self, pos, neg):
        return self.score(pos), self.score(neg)

    @torch.no_grad()
    def tail_scores(self, h, r):
        # r . (h corr t) == t . (h conv r): score all tails with one matmul
        q = torch.fft.irfft(torch.fft.rfft(self.ent(h), dim=-1) * torch.fft.rfft(self.rel(r), dim=-1),
                            n=self.ent.embedding_dim, dim=-1)
        return q @ self.ent.weight.t()

    @torch.no_grad()
    def head_scores(self, r, t):
        q = circular_correlation(self.rel(r), self.ent(t))
        return q @ self.ent.weight.t()


@torch.no_grad()
def evaluate(model, data, split, device, rank, world, bs=256):
    model.eval()
    triples = data.split[split][rank::world]
    totals = torch.zeros(5, device=device, dtype=torch.float64)
    for i in range(0, len(triples), bs):
        b = triples[i:i + bs].to(device)
        tail_s = model.tail_scores(b[:, 0], b[:, 1])
        head_s = model.head_scores(b[:, 1], b[:, 2])
        for scores, gold, known in ((tail_s, b[:, 2], [data.true_tails[(h, r)] for h, r, _ in b.tolist()]),
                                    (head_s, b[:, 0], [data.true_heads[(r, t)] for _, r, t in b.tolist()])):
            ref = scores.gather(1, gold.unsqueeze(1))
            for j, k in enumerate(known):
                scores[j, list(k)] = -float("inf")
            ranks = (scores > ref).sum(1).double() + 1
            totals += torch.stack([(1 / ranks).sum(), (ranks <= 1).sum(), (ranks <= 3).sum(),
                                   (ranks <= 10).sum(), torch.tensor(float(len(ranks)), device=device)]).double()
    dist.all_reduce(totals)
    return {"mrr": (totals[0] / totals[4]).item(), "hits@1": (totals[1] / totals[4]).item(),
            "hits@3": (totals[2] / totals[4]).item(), "hits@10": (totals[3] / totals[4]).item()}


def main():
    args = build_parser().parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    set_seed(args.seed)

    data = CodexData(args.data)
    train_set = NegativeSampler(data.split["train"], data.num_ent, args.num_negs)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    model = HolE(data.num_ent, data.num_rel, args.dim).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.wd)

    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        print(f"[hole] {data.num_ent} entities, {data.num_rel} relations, world size {world}")

    best_mrr = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        start = time.time()
        epoch_loss = torch.zeros(2, device=device)
        for pos, neg in loader:
            pos, neg = pos.to(device, non_blocking=True), neg.to(device, non_blocking=True)
            pos_score, neg_score = model(pos, neg)
            loss = F.softplus(-pos_score).mean() + F.softplus(neg_score).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            epoch_loss += torch.stack([loss.detach(), torch.ones_like(loss)])
        dist.all_reduce(epoch_loss)
        if rank == 0:
            print(f"epoch {epoch:4d} | loss {(epoch_loss[0] / epoch_loss[1]).item():.4f} | {time.time() - start:.1f}s",
                  flush=True)

        if (epoch + 1) % args.valid_every == 0:
            metrics = evaluate(model.module, data, "valid", device, rank, world)
            if rank == 0:
                print(f"  valid: " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()), flush=True)
                if metrics["mrr"] > best_mrr:
                    best_mrr = metrics["mrr"]
                    torch.save({"epoch": epoch, "model": model.module.state_dict(), "metrics": metrics},
                               os.path.join(args.output, "best.pt"))
            dist.barrier()

    best = torch.load(os.path.join(args.output, "best.pt"), map_location=device)
    model.module.load_state_dict(best["model"])
    metrics = evaluate(model.module, data, "test", device, rank, world)
    if rank == 0:
        print(f"test (epoch {best['epoch']}): {metrics}", flush=True)
        with open(os.path.join(args.output, "test.json"), "w") as f:
            json.dump(metrics, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
