"""DistMult on Wikidata5M (transductive) with FSDP-sharded embedding tables.

Single-node launcher based on torch.multiprocessing.spawn:

    python 13_fsdp_distmult_wikidata5m_spawn.py --gpus 8 --data /data/wikidata5m --out ckpt/w5m_distmult
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP, StateDictType
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--port", type=int, default=29533)
    p.add_argument("--data", default="/data/wikidata5m")
    p.add_argument("--out", default="ckpt/w5m_distmult")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--neg", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--eval_batch", type=int, default=16)
    p.add_argument("--eval_limit", type=int, default=5000)
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


def load_wikidata5m(root):
    """Map Q/P ids to contiguous ints, sorted, so every process builds identical ids; cached by rank 0."""
    cache = os.path.join(root, "w5m_ids.pt")
    if os.path.exists(cache):
        return torch.load(cache)
    names = {s: os.path.join(root, f"wikidata5m_transductive_{s}.txt") for s in ("train", "valid", "test")}
    rows = {}
    for s, path in names.items():
        with open(path) as f:
            rows[s] = [l.split() for l in f if l.strip()]
    ents = sorted({x for rs in rows.values() for h, _, t in rs for x in (h, t)})
    rels = sorted({r for rs in rows.values() for _, r, _ in rs})
    e2i, r2i = {e: i for i, e in enumerate(ents)}, {r: i for i, r in enumerate(rels)}
    data = {s: torch.tensor([[e2i[h], r2i[r], e2i[t]] for h, r, t in rs], dtype=torch.long) for s, rs in rows.items()}
    data["num_entities"], data["num_relations"] = len(ents), len(rels)
    torch.save(data, cache + ".tmp")
    os.replace(cache + ".tmp", cache)
    return data


class DistMult(nn.Module):
    def __init__(self, n_ent, n_rel, dim):
        super().__init__()
        self.ent = nn.Embedding(n_ent, dim)
        self.rel = nn.Embedding(n_rel, dim)
        nn.init.normal_(self.ent.weight, std=dim ** -0.5)
        nn.init.normal_(self.rel.weight, std=dim ** -0.5)

    def forward(self, h, r, t=None, neg=None):
        q = self.ent(h) * self.rel(r)
        if t is None:                                   # score every entity (evaluation)
            return q @ self.ent.weight.t()
        pos = (q * self.ent(t)).sum(-1)
        negs = q @ self.ent(neg).t()                    # negatives shared by the batch
        return pos, negs


def sorted_keys(triples, n_rel, n_ent):
    h, r, t = triples.unbind(1)
    return torch.sort((h * n_rel + r) * n_ent + t).values


def known_tails(keys, h, r, n_rel, n_ent):
    """(row, entity) pairs of all known answers of the queries (h, r, ?), from the sorted key table."""
    base = (h * n_rel + r) * n_ent
    lo = torch.searchsorted(keys, base).tolist()
    hi = torch.searchsorted(keys, base + n_ent).tolist()
    rows, cols = [], []
    for i, (a, b) in enumerate(zip(lo, hi)):
        rows.append(torch.full((b - a,), i, dtype=torch.long, device=keys.device))
        cols.append(keys[a:b] - base[i])
    return torch.cat(rows), torch.cat(cols)


@torch.no_grad()
def evaluate(model, queries, keys, n_rel, n_ent, bs, device, rank, world):
    """Tail prediction on queries incl. reciprocal rows (r + n_rel/2). Every rank runs the same number of forwards."""
    model.eval()
    per = math.ceil(len(queries) / world)
    mine = queries[rank * per:(rank + 1) * per]
    acc = torch.zeros(4, dtype=torch.float64, device=device)
    for b in range(math.ceil(per / bs)):
        q = mine[b * bs:(b + 1) * bs].to(device)
        n_real = q.size(0)
        if n_real == 0:
            q = queries[:1].to(device)
        scores = model(q[:, 0], q[:, 1])
        if n_real == 0:
            continue
        gold = scores.gather(1, q[:, 2:3])
        rows, cols = known_tails(keys, q[:, 0], q[:, 1], n_rel, n_ent)
        scores[rows, cols] = float("-inf")
        rk = 1 + (scores > gold).sum(1).double()
        acc += torch.stack([(1 / rk).sum(), (rk <= 1).sum(), (rk <= 10).sum(),
                            torch.tensor(float(n_real), device=device, dtype=torch.float64)])
    dist.all_reduce(acc)
    return {"mrr": (acc[0] / acc[3]).item(), "hits@1": (acc[1] / acc[3]).item(), "hits@10": (acc[2] / acc[3]).item()}


def checkpoint(model, opt, epoch, path, rank):
    # collective: every rank takes part, only rank 0 gets (and writes) the full state
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        model_state = model.state_dict()
        optim_state = FSDP.optim_state_dict(model, opt)
    if rank == 0:
        torch.save({"epoch": epoch, "model": model_state, "optim": optim_state}, path)
    dist.barrier()


def worker(local_rank, world_size, args):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=local_rank, world_size=world_size)
    rank, device = local_rank, torch.device("cuda", local_rank)

    if rank == 0:
        data = load_wikidata5m(args.data)
    dist.barrier()
    if rank != 0:
        data = load_wikidata5m(args.data)
    n_ent, n_rel = data["num_entities"], data["num_relations"]

    def reciprocal(x):
        return torch.cat([x, torch.stack([x[:, 2], x[:, 1] + n_rel, x[:, 0]], 1)])

    train = reciprocal(data["train"])
    all_q = reciprocal(torch.cat([data["train"], data["valid"], data["test"]]))
    keys = sorted_keys(all_q, 2 * n_rel, n_ent).to(device)
    g = torch.Generator().manual_seed(0)
    valid = reciprocal(data["valid"])
    valid = valid[torch.randperm(len(valid), generator=g)[:args.eval_limit]]

    torch.manual_seed(0)
    # one FSDP unit: the tables are sharded at rest and gathered only inside forward/backward,
    # so forward() may use self.ent.weight directly
    model = FSDP(DistMult(n_ent, 2 * n_rel, args.dim), device_id=device, sync_module_states=True)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    start_epoch = 0
    ckpt_path = os.path.join(args.out, "last.pt")
    if args.resume and os.path.exists(ckpt_path):
        full = torch.load(ckpt_path, map_location="cpu")
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=True, rank0_only=False)):
            model.load_state_dict(full["model"])
            opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, full["optim"]))
        start_epoch = full["epoch"] + 1
        del full

    ds = TensorDataset(train)
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch, sampler=sampler, drop_last=True, num_workers=4, pin_memory=True)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{n_ent} entities, {n_rel} relations, {len(train)} training rows, {len(loader)} steps/epoch", flush=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, tot = time.time(), torch.zeros(2, device=device)
        for (b,) in loader:
            b = b.to(device, non_blocking=True)
            neg = torch.randint(0, n_ent, (args.neg,), device=device)
            pos, negs = model(b[:, 0], b[:, 1], b[:, 2], neg)
            logits = torch.cat([pos[:, None], negs], 1)
            loss = F.cross_entropy(logits, torch.zeros(len(b), dtype=torch.long, device=device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)
        res = evaluate(model, valid, keys, 2 * n_rel, n_ent, args.eval_batch, device, rank, world_size)
        if rank == 0:
            print(f"epoch {epoch} loss {(tot[0] / tot[1]).item():.4f} valid {res} ({time.time() - t0:.0f}s)",
                  flush=True)
        checkpoint(model, opt, epoch, ckpt_path, rank)

    dist.destroy_process_group()


if __name__ == "__main__":
    args = get_args()
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)
