#!/usr/bin/env python
"""HolE (holographic embeddings, Nickel et al. 2016) trained with DDP on pre-sharded data.

The triple file of the full graph is too big to load in every process, so
scripts/shard_triples.py writes it as id triples in `world_size` shuffled .npy
files, train.00.npy, train.01.npy, ...; rank i reads only shard i and every
rank runs the same number of steps per epoch.

    torchrun --nproc_per_node 4 09_hole_sharded_files.py --data /data/kg/freebase-shards --steps_per_epoch 5000
"""
import argparse
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

log = logging.getLogger("hole")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="out/hole")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--neg", type=int, default=64)
    ap.add_argument("--batch_size", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--margin", type=float, default=1.0)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--steps_per_epoch", type=int, default=5000)
    ap.add_argument("--valid_size", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=17)
    return ap.parse_args()


def ccorr(a, b):
    """Circular correlation a * b via FFT."""
    return torch.fft.irfft(torch.conj(torch.fft.rfft(a, dim=-1)) * torch.fft.rfft(b, dim=-1),
                           n=a.shape[-1], dim=-1)


class HolE(nn.Module):
    def __init__(self, n_ent, n_rel, dim):
        super().__init__()
        self.ent = nn.Embedding(n_ent, dim)
        self.rel = nn.Embedding(n_rel, dim)
        nn.init.normal_(self.ent.weight, std=dim ** -0.5)
        nn.init.normal_(self.rel.weight, std=dim ** -0.5)

    def forward(self, h, r, t):
        return (self.rel(r) * ccorr(self.ent(h), self.ent(t))).sum(-1)


class ShardBatches:
    """Endless shuffled mini-batches over this rank's shard, with uniform tail/head corruption."""

    def __init__(self, triples, n_ent, batch_size, neg, generator, device):
        self.triples = torch.from_numpy(triples)
        self.n_ent, self.bs, self.neg = n_ent, batch_size, neg
        self.g = generator
        self.device = device
        self._perm, self._pos = None, 0

    def _reshuffle(self):
        self._perm = torch.randperm(len(self.triples), generator=self.g)
        self._pos = 0

    def next(self):
        if self._perm is None or self._pos + self.bs > len(self._perm):
            self._reshuffle()
        idx = self._perm[self._pos:self._pos + self.bs]
        self._pos += self.bs
        pos = self.triples[idx]
        neg = pos.repeat_interleave(self.neg, dim=0)
        rnd = torch.randint(self.n_ent, (len(neg),), generator=self.g)
        head = torch.rand(len(neg), generator=self.g) < 0.5
        neg[head, 0] = rnd[head]
        neg[~head, 2] = rnd[~head]
        return pos.to(self.device, non_blocking=True), neg.to(self.device, non_blocking=True)


@torch.no_grad()
def ranking_eval(model, triples, n_ent, device, rank, world, bs=128):
    """Raw tail ranking on a sample of held-out triples (full filtering is too slow at this size)."""
    model.eval()
    part = torch.from_numpy(triples[rank::world]).to(device)
    ent_w = model.ent.weight
    acc = torch.zeros(3, device=device)
    for i in range(0, len(part), bs):
        b = part[i:i + bs]
        hv, rv = model.ent(b[:, 0]), model.rel(b[:, 1])
        # score(h, r, t) = <r, ccorr(h, t)> = <t, ccorr-adjoint>; compute for all t via FFT
        fh = torch.fft.rfft(hv, dim=-1)
        fr = torch.fft.rfft(rv, dim=-1)
        q = torch.fft.irfft(fh * fr, n=hv.shape[-1], dim=-1)
        scores = q @ ent_w.t()
        gold = scores.gather(1, b[:, 2:3])
        ranks = (scores > gold).sum(1).float() + 1
        acc += torch.stack([(1 / ranks).sum(), (ranks <= 10).float().sum(), ranks.new_tensor(len(b))])
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [%(name)s] %(message)s")

    shard = np.load(os.path.join(args.data, f"train.{rank:02d}.npy"), mmap_mode="r")
    shard = np.ascontiguousarray(shard, dtype=np.int64)
    valid = np.load(os.path.join(args.data, "valid.npy"))[:args.valid_size].astype(np.int64)
    n_ent = int(max(shard[:, 0].max(), shard[:, 2].max())) + 1
    n_rel = int(shard[:, 1].max()) + 1
    log.info("rank %d shard: %d triples, %d entities, %d relations", rank, len(shard), n_ent, n_rel)

    torch.manual_seed(args.seed)
    model = HolE(n_ent, n_rel, args.dim).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    g = torch.Generator()
    g.manual_seed(args.seed * 1000 + rank)
    batches = ShardBatches(shard, n_ent, args.batch_size, args.neg, g, device)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = -1.0
    for epoch in range(args.epochs):
        t0 = time.time()
        run = torch.zeros((), device=device)
        for _ in range(args.steps_per_epoch):
            pos, neg = batches.next()
            p = model(pos[:, 0], pos[:, 1], pos[:, 2])
            n = model(neg[:, 0], neg[:, 1], neg[:, 2]).view(-1, args.neg)
            loss = F.relu(args.margin - p.unsqueeze(1) + n).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            run += loss.detach()
        dist.all_reduce(run, op=dist.ReduceOp.AVG)
        mrr, h10 = ranking_eval(model.module, valid, n_ent, device, rank, world)
        log.info("epoch %d loss %.4f valid raw MRR %.4f H@10 %.4f (%.0fs)", epoch,
                 run.item() / args.steps_per_epoch, mrr, h10, time.time() - t0)
        if rank == 0 and mrr > best:
            best = mrr
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "n_ent": n_ent,
                        "n_rel": n_rel, "args": vars(args)}, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
