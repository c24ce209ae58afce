"""TransE on Wikidata5M (transductive split), DDP, with a preprocessed-tensor cache.

Parsing the 21M raw triples and building the filter index takes ~15 minutes, so the
result is cached under <data>/processed/ and reused by later runs.

    torchrun --nproc_per_node=8 15_transe_wikidata5m_cached.py --data /datasets/wikidata5m
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

SPLITS = ("train", "valid", "test")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/datasets/wikidata5m")
    ap.add_argument("--save", default="checkpoints/transe_w5m")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--margin", type=float, default=12.0)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--neg", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--eval_queries", type=int, default=10000)
    ap.add_argument("--eval_batch", type=int, default=32)
    return ap.parse_args()


def build_index(triples, n_ent, n_rel):
    """Sorted int64 keys; the answers of (a, b, ?) form one contiguous run."""
    h, r, t = triples.unbind(1)
    return {"hr_t": torch.sort((h * n_rel + r) * n_ent + t).values,
            "rt_h": torch.sort((t * n_rel + r) * n_ent + h).values}


def load_processed(root):
    cache = os.path.join(root, "processed", "wikidata5m_transductive.pt")
    if os.path.exists(cache):
        return torch.load(cache)
    raw = {}
    for s in SPLITS:
        with open(os.path.join(root, f"wikidata5m_transductive_{s}.txt"), encoding="utf-8") as f:
            raw[s] = [line.split("\t") for line in f.read().splitlines() if line]
    entities = sorted({e for s in SPLITS for h, _, t in raw[s] for e in (h, t)})
    relations = sorted({r for s in SPLITS for _, r, _ in raw[s]})
    e2i = {e: i for i, e in enumerate(entities)}
    r2i = {r: i for i, r in enumerate(relations)}
    out = {s: torch.tensor([(e2i[h], r2i[r], e2i[t]) for h, r, t in raw[s]], dtype=torch.long) for s in SPLITS}
    out["n_ent"], out["n_rel"] = len(entities), len(relations)
    out["index"] = build_index(torch.cat([out[s] for s in SPLITS]), out["n_ent"], out["n_rel"])
    os.makedirs(os.path.dirname(cache), exist_ok=True)
    torch.save(out, cache)
    return out


class TransE(nn.Module):
    def __init__(self, n_ent, n_rel, dim):
        super().__init__()
        self.ent = nn.Embedding(n_ent, dim)
        self.rel = nn.Embedding(n_rel, dim)
        nn.init.uniform_(self.ent.weight, -6 / dim ** 0.5, 6 / dim ** 0.5)
        nn.init.uniform_(self.rel.weight, -6 / dim ** 0.5, 6 / dim ** 0.5)

    def forward(self, pos, neg_ent, corrupt_tail):
        h, r, t = self.ent(pos[:, 0]), self.rel(pos[:, 1]), self.ent(pos[:, 2])
        n = self.ent(neg_ent)                       # B x K x d
        d_pos = (h + r - t).norm(p=1, dim=-1)
        if corrupt_tail:
            d_neg = (h + r).unsqueeze(1).sub(n).norm(p=1, dim=-1)
        else:
            d_neg = n.add(r.unsqueeze(1)).sub(t.unsqueeze(1)).norm(p=1, dim=-1)
        return d_pos, d_neg


def answers(keys, a, b, n_rel, n_ent):
    base = (a * n_rel + b) * n_ent
    lo = torch.searchsorted(keys, base).tolist()
    hi = torch.searchsorted(keys, base + n_ent).tolist()
    rows = torch.cat([torch.full((y - x,), i, dtype=torch.long) for i, (x, y) in enumerate(zip(lo, hi))])
    cols = torch.cat([keys[x:y] - base[i] for i, (x, y) in enumerate(zip(lo, hi))])
    return rows.to(keys.device), cols


@torch.no_grad()
def evaluate(model, queries, index, n_ent, n_rel, bs, device, rank, world):
    model.eval()
    mine = queries[rank::world]
    acc = torch.zeros(4, dtype=torch.float64, device=device)
    E = model.ent.weight
    for i in range(0, len(mine), bs):
        q = mine[i:i + bs].to(device)
        h, r, t = q.unbind(1)
        for target, query, keys, a, b in ((t, model.ent(h) + model.rel(r), index["hr_t"], h, r),
                                          (h, model.ent(t) - model.rel(r), index["rt_h"], t, r)):
            d = torch.cdist(query, E, p=1)
            gold = d.gather(1, target[:, None])
            rows, cols = answers(keys, a, b, n_rel, n_ent)
            d[rows, cols] = float("inf")
            rk = 1 + (d < gold).sum(1).double()
            acc += torch.stack([(1 / rk).sum(), (rk <= 1).sum(), (rk <= 10).sum(),
                                torch.tensor(float(len(rk)), dtype=torch.float64, device=device)])
    dist.all_reduce(acc)
    return {"mrr": (acc[0] / acc[3]).item(), "hits@1": (acc[1] / acc[3]).item(), "hits@10": (acc[2] / acc[3]).item()}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    data = load_processed(args.data)
    n_ent, n_rel = data["n_ent"], data["n_rel"]
    index = {k: v.to(device) for k, v in data["index"].items()}
    g = torch.Generator().manual_seed(2024)
    valid_q = data["valid"][torch.randperm(len(data["valid"]), generator=g)[:args.eval_queries]]

    ds = TensorDataset(data["train"])
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch, sampler=sampler, drop_last=True, num_workers=6, pin_memory=True)

    torch.manual_seed(0)
    model = TransE(n_ent, n_rel, args.dim).to(device)
    ddp = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)
    opt = torch.optim.Adam(ddp.parameters(), lr=args.lr)
    if rank == 0:
        os.makedirs(args.save, exist_ok=True)
        print(f"{n_ent:,} entities, {n_rel} relations, {len(ds):,} train triples, {len(loader)} steps/epoch/rank",
              flush=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        tic, agg = time.time(), torch.zeros(2, device=device)
        for step, (pos,) in enumerate(loader):
            pos = pos.to(device, non_blocking=True)
            neg = torch.randint(0, n_ent, (pos.size(0), args.neg), device=device)
            d_pos, d_neg = ddp(pos, neg, corrupt_tail=step % 2 == 0)
            loss = F.relu(args.margin + d_pos.unsqueeze(1) - d_neg).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            agg += torch.stack([loss.detach(), torch.ones((), device=device)])
            if rank == 0 and step % 2000 == 0:
                print(f"epoch {epoch} step {step}/{len(loader)} loss {loss.item():.4f}", flush=True)
        dist.all_reduce(agg)
        res = evaluate(model, valid_q, index, n_ent, n_rel, args.eval_batch, device, rank, world)
        if rank == 0:
            print(f"== epoch {epoch}: loss {(agg[0] / agg[1]).item():.4f}, valid {res}, {time.time() - tic:.0f}s",
                  flush=True)
            torch.save({"epoch": epoch, "model": model.state_dict(), "opt": opt.state_dict(), "valid": res},
                       os.path.join(args.save, f"epoch_{epoch}.pt"))
        dist.barrier()

    res = evaluate(model, data["test"], index, n_ent, n_rel, args.eval_batch, device, rank, world)
    if rank == 0:
        print(f"test: {res}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
