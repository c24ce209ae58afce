"""RotatE with sparse entity gradients and SparseAdam, one process per GPU.

The entity table is too large for a dense Adam state update every step, so the
entity embedding uses sparse=True + SparseAdam. NCCL cannot all-reduce sparse
tensors (and DDP would densify them anyway), so the entity gradient is synced
by hand: every rank all-gathers the (row index, row grad) pairs it touched and
the union is averaged. The small relation table stays dense and is all-reduced.

    python 07_rotate_sparse_spawn.py --data data/YAGO3-10 --gpus 4
"""
import argparse
import math
import os
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--dim", type=int, default=500)
    p.add_argument("--gamma", type=float, default=24.0)
    p.add_argument("--temp", type=float, default=1.0)
    p.add_argument("--neg", type=int, default=256)
    p.add_argument("--batch", type=int, default=1024, help="per process")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--steps", type=int, default=100000)
    p.add_argument("--eval_every", type=int, default=10000)
    p.add_argument("--port", type=str, default="29531")
    p.add_argument("--save", default="runs/rotate_sparse")
    return p.parse_args()


def load(data):
    def read_dict(fn):
        with open(os.path.join(data, fn)) as f:
            return {name: int(i) for i, name in (l.rstrip("\n").split("\t") for l in f)}

    e2i, r2i = read_dict("entities.dict"), read_dict("relations.dict")

    def read(fn):
        with open(os.path.join(data, fn)) as f:
            rows = [l.rstrip("\n").split("\t") for l in f]
        return torch.tensor([[e2i[h], r2i[r], e2i[t]] for h, r, t in rows])

    return read("train.txt"), read("valid.txt"), read("test.txt"), len(e2i), len(r2i)


class RotatE(nn.Module):
    def __init__(self, n_ent, n_rel, dim, gamma):
        super().__init__()
        self.gamma = gamma
        self.rng = (gamma + 2.0) / dim
        self.entity = nn.Embedding(n_ent, 2 * dim, sparse=True)
        self.relation = nn.Embedding(n_rel, dim)
        nn.init.uniform_(self.entity.weight, -self.rng, self.rng)
        nn.init.uniform_(self.relation.weight, -self.rng, self.rng)

    def _dist(self, h, phase, t):
        hr, hi = h.chunk(2, -1)
        tr, ti = t.chunk(2, -1)
        rr, ri = torch.cos(phase), torch.sin(phase)
        re = hr * rr - hi * ri - tr
        im = hr * ri + hi * rr - ti
        return torch.sqrt(re * re + im * im + 1e-12).sum(-1)

    def forward(self, pos, neg, temp):
        h = self.entity(pos[:, 0]).unsqueeze(1)
        t = self.entity(pos[:, 2]).unsqueeze(1)
        phase = (self.relation(pos[:, 1]) / (self.rng / math.pi)).unsqueeze(1)
        n = self.entity(neg)
        p_score = self.gamma - self._dist(h, phase, t).squeeze(1)
        n_score = self.gamma - self._dist(h, phase, n)
        w = torch.softmax(n_score * temp, dim=1).detach()
        return 0.5 * (-F.logsigmoid(p_score).mean() - (w * F.logsigmoid(-n_score)).sum(1).mean())

    @torch.no_grad()
    def all_tails(self, h_idx, r_idx, chunk=4096):
        h = self.entity.weight[h_idx].unsqueeze(1)
        phase = (self.relation.weight[r_idx] / (self.rng / math.pi)).unsqueeze(1)
        out = []
        for s in range(0, self.entity.num_embeddings, chunk):
            t = self.entity.weight[s:s + chunk].unsqueeze(0)
            out.append(self.gamma - self._dist(h, phase, t))
        return torch.cat(out, 1)


def sync_sparse_grad(weight, world):
    g = weight.grad.coalesce()
    idx, val = g.indices()[0], g.values()
    n = torch.tensor([idx.numel()], device=idx.device, dtype=torch.long)
    counts = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(counts, n)
    counts = [int(c.item()) for c in counts]
    m = max(counts)
    idx_p = torch.zeros(m, dtype=idx.dtype, device=idx.device)
    val_p = torch.zeros(m, val.size(1), dtype=val.dtype, device=val.device)
    idx_p[:idx.numel()] = idx
    val_p[:idx.numel()] = val
    all_idx = [torch.empty_like(idx_p) for _ in range(world)]
    all_val = [torch.empty_like(val_p) for _ in range(world)]
    dist.all_gather(all_idx, idx_p)
    dist.all_gather(all_val, val_p)
    idx_cat = torch.cat([a[:c] for a, c in zip(all_idx, counts)])
    val_cat = torch.cat([v[:c] for v, c in zip(all_val, counts)]) / world
    weight.grad = torch.sparse_coo_tensor(idx_cat.unsqueeze(0), val_cat,
                                          weight.shape).coalesce()


def sync_dense_grads(params, world):
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(world)


@torch.no_grad()
def evaluate(model, triples, filt, device, rank, world, bs=32):
    part = triples[rank::world]
    acc = torch.zeros(4, dtype=torch.float64, device=device)
    for s in range(0, part.size(0), bs):
        b = part[s:s + bs].to(device)
        sc = model.all_tails(b[:, 0], b[:, 1])
        tgt = sc.gather(1, b[:, 2:3]).clone()
        for i, (h, r, t) in enumerate(b.tolist()):
            sc[i, list(filt[(h, r)])] = float("-inf")
        sc.scatter_(1, b[:, 2:3], tgt)
        rk = (sc > tgt).sum(1).double() + 1
        acc += torch.stack([(1 / rk).sum(), (rk <= 1).double().sum(),
                            (rk <= 10).double().sum(), rk.new_tensor(rk.numel())])
    dist.all_reduce(acc)
    return {"mrr": (acc[0] / acc[3]).item(), "h@1": (acc[1] / acc[3]).item(),
            "h@10": (acc[2] / acc[3]).item()}


def worker(rank, world, args, data):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = args.port
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    device = torch.device("cuda", rank)

    train, valid, test, n_ent, n_rel = data
    # add reciprocal triples, tail prediction only
    def recip(x):
        return torch.cat([x, torch.stack([x[:, 2], x[:, 1] + n_rel, x[:, 0]], 1)])
    train, valid, test = recip(train), recip(valid), recip(test)
    filt = defaultdict(set)
    for h, r, t in torch.cat([train, valid, test]).tolist():
        filt[(h, r)].add(t)

    torch.manual_seed(0)
    model = RotatE(n_ent, 2 * n_rel, args.dim, args.gamma).to(device)
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    opt_sparse = torch.optim.SparseAdam([model.entity.weight], lr=args.lr)
    opt_dense = torch.optim.Adam([model.relation.weight], lr=args.lr)

    train_dev = train.to(device)
    gen = torch.Generator(device=device).manual_seed(1000 + rank)
    if rank == 0:
        os.makedirs(args.save, exist_ok=True)
    best, t0 = -1.0, time.time()
    for step in range(1, args.steps + 1):
        idx = torch.randint(train_dev.size(0), (args.batch,), device=device, generator=gen)
        pos = train_dev[idx]
        neg = torch.randint(n_ent, (args.batch, args.neg), device=device, generator=gen)
        loss = model(pos, neg, args.temp)
        opt_sparse.zero_grad(set_to_none=True)
        opt_dense.zero_grad(set_to_none=True)
        loss.backward()
        sync_sparse_grad(model.entity.weight, world)
        sync_dense_grads([model.relation.weight], world)
        opt_sparse.step()
        opt_dense.step()

        if rank == 0 and step % 500 == 0:
            print(f"step {step} loss {loss.item():.4f} ({time.time() - t0:.0f}s)", flush=True)
        if step % args.eval_every == 0:
            res = evaluate(model, valid, filt, device, rank, world)
            if rank == 0:
                print(f"[valid @ {step}] {res}", flush=True)
                if res["mrr"] > best:
                    best = res["mrr"]
                    torch.save(model.state_dict(), os.path.join(args.save, "best.pt"))
            dist.barrier()

    model.load_state_dict(torch.load(os.path.join(args.save, "best.pt"), map_location=device))
    res = evaluate(model, test, filt, device, rank, world)
    if rank == 0:
        print(f"[test] {res}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse()
    data = load(args.data)
    mp.spawn(worker, args=(args.gpus, args, data), nprocs=args.gpus, join=True)
