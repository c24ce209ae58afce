"""ComplEx on the product knowledge graph export (pre-sharded parquet, one shard per rank).

The Spark export job writes
    <root>/train/part-{rank:05d}-of-{world:05d}.parquet   (columns: head, relation, tail; int64 ids)
    <root>/valid.parquet, <root>/test.parquet             (+ column neg: 1000 pre-filtered tail candidates)
so every rank reads only its own shard.  Each epoch is a fixed number of steps on every rank.

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29400 \
        19_complex_sharded_parquet.py --root /mnt/shared/pkg_export/2024-05-01 --steps_per_epoch 20000
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--ckpt_dir", default="/mnt/shared/kge_ckpt/complex_pkg")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--neg", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--reg", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--steps_per_epoch", type=int, default=20000)
    p.add_argument("--eval_batch", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def read_shard(root, rank, world):
    df = pd.read_parquet(os.path.join(root, "train", f"part-{rank:05d}-of-{world:05d}.parquet"))
    return torch.from_numpy(df[["head", "relation", "tail"]].to_numpy(dtype=np.int64))


def read_eval(root, name):
    df = pd.read_parquet(os.path.join(root, f"{name}.parquet"))
    triples = torch.from_numpy(df[["head", "relation", "tail"]].to_numpy(dtype=np.int64))
    negs = torch.from_numpy(np.stack(df["neg"].to_numpy()).astype(np.int64))
    return triples, negs


class ComplEx(nn.Module):
    def __init__(self, n_ent, n_rel, dim):
        super().__init__()
        self.ent_re = nn.Embedding(n_ent, dim)
        self.ent_im = nn.Embedding(n_ent, dim)
        self.rel_re = nn.Embedding(n_rel, dim)
        self.rel_im = nn.Embedding(n_rel, dim)
        for e in (self.ent_re, self.ent_im, self.rel_re, self.rel_im):
            nn.init.normal_(e.weight, std=1e-2)

    def forward(self, h, r, t):
        """h, r: [B]; t: [B] or [B, K]. Returns scores with t's shape, and the L2 of the factors."""
        hr, hi = self.ent_re(h), self.ent_im(h)
        rr, ri = self.rel_re(r), self.rel_im(r)
        tr, ti = self.ent_re(t), self.ent_im(t)
        a, b = hr * rr - hi * ri, hr * ri + hi * rr
        if t.dim() == 2:
            a, b = a.unsqueeze(1), b.unsqueeze(1)
        score = (a * tr + b * ti).sum(-1)
        reg = (hr ** 2 + hi ** 2).sum() + (rr ** 2 + ri ** 2).sum()
        return score, reg


def shard_batches(shard, batch, epoch, seed, rank):
    """Endless shuffled batches from this rank's shard."""
    g = torch.Generator().manual_seed(seed * 100003 + epoch * 1009 + rank)
    while True:
        perm = torch.randperm(len(shard), generator=g)
        for i in range(0, len(perm) - batch + 1, batch):
            yield shard[perm[i:i + batch]]


@torch.no_grad()
def evaluate(model, triples, negs, device, rank, world, bs):
    model.eval()
    mine, mine_neg = triples[rank::world], negs[rank::world]
    acc = torch.zeros(4, dtype=torch.float64, device=device)
    for i in range(0, len(mine), bs):
        x = mine[i:i + bs].to(device)
        cand = torch.cat([x[:, 2:3], mine_neg[i:i + bs].to(device)], 1)   # gold first
        s, _ = model(x[:, 0], x[:, 1], cand)
        rk = 1 + (s[:, 1:] > s[:, :1]).sum(1).double()
        acc += torch.stack([(1 / rk).sum(), (rk <= 1).sum(), (rk <= 10).sum(),
                            torch.tensor(float(len(rk)), dtype=torch.float64, device=device)])
    dist.all_reduce(acc)
    return {"mrr": (acc[0] / acc[3]).item(), "hits@1": (acc[1] / acc[3]).item(), "hits@10": (acc[2] / acc[3]).item()}


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    shard = read_shard(args.root, rank, world)
    valid, valid_neg = read_eval(args.root, "valid")
    test, test_neg = read_eval(args.root, "test")
    n_ent = int(torch.cat([shard[:, 0], shard[:, 2]]).max()) + 1
    n_rel = int(shard[:, 1].max()) + 1
    print(f"[rank {rank}] shard of {len(shard):,} triples; {n_ent:,} entities, {n_rel} relations", flush=True)

    torch.manual_seed(args.seed)
    model = ComplEx(n_ent, n_rel, args.dim).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adagrad(ddp.parameters(), lr=args.lr)
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        ddp.train()
        batches = shard_batches(shard, args.batch, epoch, args.seed, rank)
        t0, agg = time.time(), torch.zeros(2, device=device)
        for step in range(args.steps_per_epoch):
            x = next(batches).to(device, non_blocking=True)
            neg_t = torch.randint(0, n_ent, (x.size(0), args.neg), device=device)
            cand = torch.cat([x[:, 2:3], neg_t], 1)
            scores, reg = ddp(x[:, 0], x[:, 1], cand)
            loss = F.cross_entropy(scores, torch.zeros(x.size(0), dtype=torch.long, device=device))
            loss = loss + args.reg * reg / x.size(0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            agg += torch.stack([loss.detach(), torch.ones((), device=device)])
            if rank == 0 and step % 1000 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)
        dist.all_reduce(agg)
        res = evaluate(model, valid, valid_neg, device, rank, world, args.eval_batch)
        if rank == 0:
            print(f"epoch {epoch}: loss {(agg[0] / agg[1]).item():.4f} valid {res} ({time.time() - t0:.0f}s)",
                  flush=True)
            if res["mrr"] > best:
                best = res["mrr"]
                torch.save({"epoch": epoch, "model": model.state_dict(), "n_ent": n_ent, "n_rel": n_rel},
                           os.path.join(args.ckpt_dir, "best.pt"))
        dist.barrier()

    ckpt = torch.load(os.path.join(args.ckpt_dir, "best.pt"), map_location=device)
    model.load_state_dict(ckpt["model"])
    res = evaluate(model, test, test_neg, device, rank, world, args.eval_batch)
    if rank == 0:
        print(f"test (epoch {ckpt['epoch']}): {res}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
