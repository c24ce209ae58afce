"""QuatE (Zhang et al., NeurIPS 2019) on Wikidata5M (transductive split).

Parsing the raw Wikidata5M dumps and building the filter index takes ~15 minutes,
so the result is cached as a single torch file next to the data.

    torchrun --nproc_per_node=8 16_quate_wikidata5m.py --raw_dir /datasets/wikidata5m --dim 128
"""
import argparse
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("quate")

SPLITS = {"train": "wikidata5m_transductive_train.txt",
          "valid": "wikidata5m_transductive_valid.txt",
          "test": "wikidata5m_transductive_test.txt"}


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--raw_dir", required=True)
    p.add_argument("--cache", default=None, help="defaults to <raw_dir>/quate_cache.pt")
    p.add_argument("--out", default="runs/quate_w5m")
    p.add_argument("--dim", type=int, default=128, help="quaternion dim (4x real params)")
    p.add_argument("--neg", type=int, default=64)
    p.add_argument("--batch_size", type=int, default=4096)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--reg", type=float, default=0.05)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--eval_size", type=int, default=5000)
    p.add_argument("--log_every", type=int, default=500)
    return p.parse_args()


def preprocess(raw_dir):
    ent2id, rel2id = {}, {}
    tensors = {}
    for split, fname in SPLITS.items():
        rows = []
        with open(os.path.join(raw_dir, fname), encoding="utf-8") as f:
            for line in f:
                h, r, t = line.rstrip("\n").split("\t")
                rows.append((ent2id.setdefault(h, len(ent2id)), rel2id.setdefault(r, len(rel2id)),
                             ent2id.setdefault(t, len(ent2id))))
        tensors[split] = torch.tensor(rows, dtype=torch.int64)
    return {"ent2id": ent2id, "rel2id": rel2id, **tensors}


def load_or_build(args):
    path = args.cache or os.path.join(args.raw_dir, "quate_cache.pt")
    if os.path.exists(path):
        log.info("loading cached dataset from %s", path)
        return torch.load(path)
    log.info("building dataset cache (this takes a while)")
    data = preprocess(args.raw_dir)
    torch.save(data, path)
    return data


def hamilton(a, b):
    a1, a2, a3, a4 = a.chunk(4, dim=-1)
    b1, b2, b3, b4 = b.chunk(4, dim=-1)
    return torch.cat([a1 * b1 - a2 * b2 - a3 * b3 - a4 * b4,
                      a1 * b2 + a2 * b1 + a3 * b4 - a4 * b3,
                      a1 * b3 - a2 * b4 + a3 * b1 + a4 * b2,
                      a1 * b4 + a2 * b3 - a3 * b2 + a4 * b1], dim=-1)


def unit_quaternion(r):
    r1, r2, r3, r4 = r.chunk(4, dim=-1)
    norm = torch.sqrt(r1 ** 2 + r2 ** 2 + r3 ** 2 + r4 ** 2).clamp_min(1e-9)
    return torch.cat([r1 / norm, r2 / norm, r3 / norm, r4 / norm], dim=-1)


class QuatE(nn.Module):
    def __init__(self, n_ent, n_rel, dim):
        super().__init__()
        self.ent = nn.Embedding(n_ent, 4 * dim)
        self.rel = nn.Embedding(n_rel, 4 * dim)
        nn.init.xavier_uniform_(self.ent.weight)
        nn.init.xavier_uniform_(self.rel.weight)

    def query(self, h, r):
        return hamilton(self.ent(h), unit_quaternion(self.rel(r)))

    def forward(self, pos, neg_tails):
        q = self.query(pos[:, 0], pos[:, 1])
        t = self.ent(pos[:, 2])
        n = self.ent(neg_tails)
        pos_s = (q * t).sum(-1)
        neg_s = torch.einsum("bd,bkd->bk", q, n)
        reg = (self.ent(pos[:, 0]).pow(2).mean() + t.pow(2).mean() + self.rel(pos[:, 1]).pow(2).mean())
        return pos_s, neg_s, reg


class TailNeg(Dataset):
    def __init__(self, triples, n_ent, k):
        self.triples, self.n_ent, self.k = triples, n_ent, k

    def __len__(self):
        return len(self.triples)

    def __getitem__(self, i):
        return self.triples[i], torch.randint(self.n_ent, (self.k,))


@torch.no_grad()
def sampled_eval(model, triples, n_ent, device, rank, world, n_cand=10000, bs=256):
    """Rank the gold tail among 10k random candidates (raw) - a cheap proxy used during training."""
    model.eval()
    g = torch.Generator(device="cpu").manual_seed(1234)
    cand = torch.randint(n_ent, (n_cand,), generator=g).to(device)
    mine = triples[rank::world].to(device)
    acc = torch.zeros(3, device=device, dtype=torch.float64)
    for i in range(0, len(mine), bs):
        b = mine[i:i + bs]
        q = model.query(b[:, 0], b[:, 1])
        gold = (q * model.ent(b[:, 2])).sum(-1, keepdim=True)
        s = q @ model.ent(cand).t()
        rk = (s > gold).sum(1).double() + 1
        acc += torch.stack([(1 / rk).sum(), (rk <= 10).sum().double(), rk.new_tensor(len(rk))])
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    args = cli()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank {rank}] %(message)s")

    data = load_or_build(args)
    n_ent, n_rel = len(data["ent2id"]), len(data["rel2id"])
    log.info("Wikidata5M: %d entities, %d relations, %d train triples", n_ent, n_rel, len(data["train"]))

    ds = TailNeg(data["train"], n_ent, args.neg)
    sampler = DistributedSampler(ds, shuffle=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True)

    model = QuatE(n_ent, n_rel, args.dim).to(device)
    ddp = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)
    opt = torch.optim.Adagrad(ddp.parameters(), lr=args.lr)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    valid = data["valid"][:args.eval_size]
    best = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for step, (pos, neg) in enumerate(loader, 1):
            pos, neg = pos.to(device, non_blocking=True), neg.to(device, non_blocking=True)
            ps, ns, reg = ddp(pos, neg)
            loss = F.softplus(-ps).mean() + F.softplus(ns).mean() + args.reg * reg
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % args.log_every == 0:
                log.info("epoch %d step %d/%d loss %.4f (%.0f triples/s)", epoch, step, len(loader),
                         loss.item(), step * args.batch_size * world / (time.time() - t0))

        mrr, h10 = sampled_eval(model, valid, n_ent, device, rank, world)
        log.info("epoch %d valid sampled MRR %.4f H@10 %.4f", epoch, mrr, h10)
        if rank == 0:
            torch.save({"epoch": epoch, "model": model.state_dict(), "opt": opt.state_dict()},
                       os.path.join(args.out, "last.pt"))
            if mrr > best:
                best = mrr
                torch.save(model.state_dict(), os.path.join(args.out, "best_model.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
