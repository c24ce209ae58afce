#!/usr/bin/env python
"""TorusE (Ebisu & Ichise, AAAI 2018): TransE on the torus T^n = R^n / Z^n.

    torchrun --nproc_per_node=4 19_toruse_sharded_eval.py --data data/WN18 --dim 2000 --dist eL2
"""
import argparse
import csv
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("toruse")


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data/WN18")
    p.add_argument("--out", default="runs/toruse")
    p.add_argument("--dim", type=int, default=2000)
    p.add_argument("--dist", choices=["L1", "L2", "eL2"], default="eL2")
    p.add_argument("--margin", type=float, default=2000.0)
    p.add_argument("--batch_size", type=int, default=5000)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--epochs", type=int, default=500)
    p.add_argument("--eval_every", type=int, default=25)
    p.add_argument("--eval_bs", type=int, default=2)
    return p.parse_args()


def read(root):
    def vocab(fn):
        with open(os.path.join(root, fn)) as f:
            return {n: int(i) for i, n in (l.rstrip("\n").split("\t") for l in f)}

    e, r = vocab("entities.dict"), vocab("relations.dict")
    out = {}
    for s in ("train", "valid", "test"):
        with open(os.path.join(root, f"{s}.txt")) as f:
            out[s] = np.array([(e[a], r[b], e[c]) for a, b, c in (l.rstrip("\n").split("\t") for l in f)])
    return out, len(e), len(r)


class PairSet(Dataset):
    def __init__(self, triples, n_ent):
        self.triples, self.n_ent = triples, n_ent

    def __len__(self):
        return len(self.triples)

    def __getitem__(self, i):
        pos = self.triples[i].copy()
        neg = pos.copy()
        if np.random.rand() < 0.5:
            neg[0] = np.random.randint(self.n_ent)
        else:
            neg[2] = np.random.randint(self.n_ent)
        return torch.from_numpy(pos), torch.from_numpy(neg)


class TorusE(nn.Module):
    def __init__(self, n_ent, n_rel, dim, dist_fn):
        super().__init__()
        self.ent = nn.Embedding(n_ent, dim)
        self.rel = nn.Embedding(n_rel, dim)
        nn.init.uniform_(self.ent.weight, 0, 1)
        nn.init.uniform_(self.rel.weight, 0, 1)
        self.dist_fn = dist_fn

    def torus_dist(self, x):
        frac = x - torch.floor(x)
        if self.dist_fn == "L1":
            return 2 * torch.minimum(frac, 1 - frac).sum(-1)
        if self.dist_fn == "L2":
            return 4 * (torch.minimum(frac, 1 - frac) ** 2).sum(-1)
        return 2 * (1 - torch.cos(2 * np.pi * frac)).sum(-1) / 4  # eL2

    def forward(self, trip):
        return self.torus_dist(self.ent(trip[:, 0]) + self.rel(trip[:, 1]) - self.ent(trip[:, 2]))

    @torch.no_grad()
    def tail_dists(self, h, r):
        q = (self.ent(h) + self.rel(r)).unsqueeze(1)                # B x 1 x d
        return self.torus_dist(q - self.ent.weight.unsqueeze(0))    # B x N


@torch.no_grad()
def evaluate(model, triples, known, device, rank, world, bs):
    """Filtered tail ranks for this rank's slice of the split."""
    model.eval()
    mine = triples[rank::world]
    ranks = []
    for i in range(0, len(mine), bs):
        b = torch.from_numpy(mine[i:i + bs]).to(device)
        d = model.tail_dists(b[:, 0], b[:, 1])
        gold = d.gather(1, b[:, 2:3])
        for j, (h, r, _) in enumerate(b.tolist()):
            d[j, known[(h, r)]] = float("inf")
        ranks.append((d < gold).sum(1) + 1)
    model.train()
    rk = torch.cat(ranks).double()
    return {"MRR": (1 / rk).mean().item(), "MR": rk.mean().item(),
            "H@1": (rk <= 1).double().mean().item(), "H@10": (rk <= 10).double().mean().item()}


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    data, n_ent, n_rel = read(args.data)
    known = {}
    for h, r, t in np.concatenate(list(data.values())).tolist():
        known.setdefault((h, r), []).append(t)

    ds = PairSet(data["train"], n_ent)
    sampler = DistributedSampler(ds)
    loader = DataLoader(ds, batch_size=args.batch_size // world, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    model = TorusE(n_ent, n_rel, args.dim, args.dist).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)

    metrics_file = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        metrics_file = open(os.path.join(args.out, "valid_metrics.csv"), "w", newline="")
        writer = csv.DictWriter(metrics_file, fieldnames=["epoch", "MRR", "MR", "H@1", "H@10"])
        writer.writeheader()

    best = 0.0
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        t0, total = time.time(), torch.zeros((), device=device)
        for pos, neg in loader:
            pos, neg = pos.to(device), neg.to(device)
            d_pos, d_neg = ddp(torch.cat([pos, neg])).chunk(2)
            loss = torch.relu(args.margin + d_pos - d_neg).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                # keep parameters in [0, 1): identical on every rank after the synced step
                model.ent.weight.frac_()
                model.rel.weight.frac_()
            total += loss.detach()
        dist.all_reduce(total)
        log.info("epoch %d loss %.2f (%.1fs)", epoch, total.item() / len(ds), time.time() - t0)

        if epoch % args.eval_every == 0:
            res = evaluate(model, data["valid"], known, device, rank, world, args.eval_bs)
            if rank == 0:
                log.info("epoch %d valid %s", epoch, res)
                writer.writerow({"epoch": epoch, **res})
                metrics_file.flush()
                if res["MRR"] > best:
                    best = res["MRR"]
                    torch.save({"epoch": epoch, "model": model.state_dict(), "valid": res},
                               os.path.join(args.out, "best.pt"))
            dist.barrier()

    if rank == 0:
        metrics_file.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
