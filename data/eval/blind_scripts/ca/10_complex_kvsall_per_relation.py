"""ComplEx trained 1-N (KvsAll) with BCE + label smoothing, multi-GPU.

Evaluation reports overall filtered MRR/Hits and a per-relation MRR table
(useful for spotting the 1-N / N-N relations the model fails on).

    torchrun --nproc_per_node=4 10_complex_kvsall_per_relation.py --data data/FB15k-237 --out out/cx_kvsall
"""
import argparse
import csv
import os
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class KvsAllDataset(Dataset):
    """One item per (h, r) query with the multi-hot set of true tails."""

    def __init__(self, triples, n_ent):
        tails = defaultdict(list)
        for h, r, t in triples.tolist():
            tails[(h, r)].append(t)
        self.keys = sorted(tails)
        self.tails = tails
        self.n_ent = n_ent

    def __len__(self):
        return len(self.keys)

    def __getitem__(self, i):
        h, r = self.keys[i]
        y = torch.zeros(self.n_ent)
        y[self.tails[(h, r)]] = 1.0
        return torch.tensor([h, r]), y


class ComplEx(nn.Module):
    def __init__(self, n_ent, n_rel, dim, inp_drop=0.2):
        super().__init__()
        self.d = dim
        self.ent = nn.Embedding(n_ent, 2 * dim)
        self.rel = nn.Embedding(n_rel, 2 * dim)
        self.bn = nn.LayerNorm(2 * dim)
        self.drop = nn.Dropout(inp_drop)
        nn.init.xavier_normal_(self.ent.weight)
        nn.init.xavier_normal_(self.rel.weight)

    def forward(self, hr):
        h = self.drop(self.bn(self.ent(hr[:, 0])))
        r = self.rel(hr[:, 1])
        h_re, h_im = h[:, :self.d], h[:, self.d:]
        r_re, r_im = r[:, :self.d], r[:, self.d:]
        e_re, e_im = self.ent.weight[:, :self.d], self.ent.weight[:, self.d:]
        return (h_re * r_re - h_im * r_im) @ e_re.t() + (h_re * r_im + h_im * r_re) @ e_im.t()


def read(path, e2i, r2i):
    with open(path) as f:
        return np.array([[e2i[h], r2i[r], e2i[t]] for h, r, t in csv.reader(f, delimiter="\t")],
                        dtype=np.int64)


@torch.no_grad()
def compute_ranks(model, triples, filt, device, bs=256):
    model.eval()
    ranks = []
    for s in range(0, len(triples), bs):
        b = torch.from_numpy(triples[s:s + bs]).to(device)
        logits = model(b[:, :2])
        gold = logits.gather(1, b[:, 2:3]).clone()
        for i, (h, r, t) in enumerate(b.tolist()):
            logits[i, filt[(h, r)]] = -1e4
        logits.scatter_(1, b[:, 2:3], gold)
        ranks.append((logits > gold).sum(1) + 1)
    model.train()
    return torch.cat(ranks) if ranks else torch.empty(0, dtype=torch.long, device=device)


def run_eval(model, triples, filt, device, rank, world, rel_names=None, csv_out=None):
    mine = triples[rank::world]
    local = compute_ranks(model, mine, filt, device)
    local_rel = torch.from_numpy(mine[:, 1]).to(device)
    gathered = [torch.empty_like(local) for _ in range(world)]
    gathered_rel = [torch.empty_like(local_rel) for _ in range(world)]
    dist.all_gather(gathered, local)
    dist.all_gather(gathered_rel, local_rel)
    if rank != 0:
        return None
    ranks = torch.cat(gathered).double()
    rels = torch.cat(gathered_rel)
    res = {"mrr": (1 / ranks).mean().item(),
           "h1": (ranks <= 1).double().mean().item(),
           "h3": (ranks <= 3).double().mean().item(),
           "h10": (ranks <= 10).double().mean().item()}
    if csv_out is not None:
        with open(csv_out, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["relation", "count", "mrr"])
            for r in rels.unique().tolist():
                m = rels == r
                name = rel_names[r] if rel_names else r
                w.writerow([name, int(m.sum()), round((1 / ranks[m]).mean().item(), 4)])
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dim", type=int, default=200)
    ap.add_argument("--bs", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--smoothing", type=float, default=0.1)
    ap.add_argument("--epochs", type=int, default=400)
    ap.add_argument("--eval_every", type=int, default=20)
    args = ap.parse_args()

    lr_ = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(lr_)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", lr_)

    with open(os.path.join(args.data, "entities.txt")) as f:
        ents = [l.strip() for l in f if l.strip()]
    with open(os.path.join(args.data, "relations.txt")) as f:
        rels = [l.strip() for l in f if l.strip()]
    e2i = {e: i for i, e in enumerate(ents)}
    r2i = {r: i for i, r in enumerate(rels)}
    n_ent, n_rel = len(ents), len(rels)
    splits = {s: read(os.path.join(args.data, f"{s}.txt"), e2i, r2i) for s in ("train", "valid", "test")}
    for s, x in list(splits.items()):
        splits[s] = np.concatenate([x, np.stack([x[:, 2], x[:, 1] + n_rel, x[:, 0]], 1)])
    rel_names = rels + [f"{r}_inv" for r in rels]
    filt = defaultdict(list)
    for h, r, t in np.concatenate(list(splits.values())).tolist():
        filt[(h, r)].append(t)

    ds = KvsAllDataset(splits["train"], n_ent)
    sampler = DistributedSampler(ds, shuffle=True, seed=3)
    loader = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=4, pin_memory=True)

    model = ComplEx(n_ent, 2 * n_rel, args.dim).to(device)
    ddp = DDP(model, device_ids=[lr_])
    opt = torch.optim.Adam(ddp.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.995)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        acc = torch.zeros(2, device=device)
        for hr, y in loader:
            hr, y = hr.to(device, non_blocking=True), y.to(device, non_blocking=True)
            y = (1.0 - args.smoothing) * y + args.smoothing / n_ent
            loss = F.binary_cross_entropy_with_logits(ddp(hr), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch} bce {(acc[0] / acc[1]).item():.5f}", flush=True)

        if (epoch + 1) % args.eval_every == 0:
            res = run_eval(model, splits["valid"], filt, device, rank, world)
            if rank == 0:
                print(f"  valid {res}", flush=True)
                if res["mrr"] > best:
                    best = res["mrr"]
                    torch.save(model.state_dict(), os.path.join(args.out, "best.pt"))
            dist.barrier()

    model.load_state_dict(torch.load(os.path.join(args.out, "best.pt"), map_location=device))
    res = run_eval(model, splits["test"], filt, device, rank, world, rel_names,
                   os.path.join(args.out, "test_per_relation.csv"))
    if rank == 0:
        print(f"test {res}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
