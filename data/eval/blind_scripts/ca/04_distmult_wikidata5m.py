"""DistMult on Wikidata5M (transductive split) with DDP.

The raw tsv files are ~20M triples, so we parse them once and keep a
tensor cache next to the data.

torchrun --nproc_per_node=8 04_distmult_wikidata5m.py --root /data/wikidata5m
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
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger(__name__)

SPLITS = {
    "train": "wikidata5m_transductive_train.txt",
    "valid": "wikidata5m_transductive_valid.txt",
    "test": "wikidata5m_transductive_test.txt",
}


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--batch_size", type=int, default=4096, help="per GPU")
    p.add_argument("--neg", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--l2", type=float, default=1e-6)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--eval_samples", type=int, default=5000)
    p.add_argument("--eval_chunk", type=int, default=256)
    p.add_argument("--save_dir", default="ckpt/distmult_w5m")
    p.add_argument("--workers", type=int, default=4)
    return p.parse_args()


def parse_raw(root):
    ent2id, rel2id = {}, {}
    raw = {}
    for split, fname in SPLITS.items():
        rows = []
        with open(os.path.join(root, fname), encoding="utf-8") as f:
            for line in f:
                h, r, t = line.rstrip("\n").split("\t")
                rows.append((h, r, t))
        raw[split] = rows
    ents = sorted({x for rows in raw.values() for h, _, t in rows for x in (h, t)})
    rels = sorted({r for rows in raw.values() for _, r, _ in rows})
    ent2id = {e: i for i, e in enumerate(ents)}
    rel2id = {r: i for i, r in enumerate(rels)}
    out = {"n_ent": len(ents), "n_rel": len(rels)}
    for split, rows in raw.items():
        out[split] = torch.tensor([(ent2id[h], rel2id[r], ent2id[t]) for h, r, t in rows],
                                  dtype=torch.int64)
    return out


def load_dataset(root):
    cache_path = os.path.join(root, "cache_ids.pt")
    if not os.path.exists(cache_path):
        log.info("building id cache from raw triples ...")
        data = parse_raw(root)
        torch.save(data, cache_path)
    else:
        data = torch.load(cache_path)
    return data


class DistMult(nn.Module):
    def __init__(self, n_ent, n_rel, dim):
        super().__init__()
        self.ent = nn.Embedding(n_ent, dim)
        self.rel = nn.Embedding(n_rel, dim)
        nn.init.xavier_uniform_(self.ent.weight)
        nn.init.xavier_uniform_(self.rel.weight)

    def forward(self, h, r, t, neg_t):
        eh, er, et = self.ent(h), self.rel(r), self.ent(t)
        en = self.ent(neg_t)                              # [B, K, d]
        pos = (eh * er * et).sum(-1)
        neg = torch.einsum("bd,bkd->bk", eh * er, en)
        reg = eh.pow(2).sum() + er.pow(2).sum() + et.pow(2).sum()
        return pos, neg, reg / h.size(0)

    @torch.no_grad()
    def all_tail_scores(self, h, r):
        return (self.ent(h) * self.rel(r)) @ self.ent.weight.t()


def build_filter_index(all_triples, n_ent):
    # sort (h, r) keys once; lookups are searchsorted on GPU
    key = all_triples[:, 0] * (2 ** 20) + all_triples[:, 1]
    order = torch.argsort(key)
    return key[order], all_triples[order, 2]


@torch.no_grad()
def evaluate(model, triples, filt_keys, filt_tails, device, chunk):
    model.eval()
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = triples[rank::world].to(device)
    acc = torch.zeros(4, device=device, dtype=torch.float64)
    for s in range(0, mine.size(0), chunk):
        b = mine[s:s + chunk]
        scores = model.all_tail_scores(b[:, 0], b[:, 1])
        tgt = scores.gather(1, b[:, 2:3]).clone()
        q = b[:, 0] * (2 ** 20) + b[:, 1]
        lo = torch.searchsorted(filt_keys, q)
        hi = torch.searchsorted(filt_keys, q, right=True)
        for i in range(b.size(0)):
            scores[i, filt_tails[lo[i]:hi[i]]] = float("-inf")
        scores[torch.arange(b.size(0), device=device), b[:, 2]] = tgt.squeeze(1)
        ranks = (scores > tgt).sum(1).double() + 1
        acc[0] += (1 / ranks).sum()
        acc[1] += (ranks <= 1).sum()
        acc[2] += (ranks <= 10).sum()
        acc[3] += ranks.numel()
    dist.all_reduce(acc)
    model.train()
    return {"mrr": (acc[0] / acc[3]).item(), "h1": (acc[1] / acc[3]).item(),
            "h10": (acc[2] / acc[3]).item()}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="[%(asctime)s][rank%(process)d] %(message)s")

    data = load_dataset(args.root)
    n_ent, n_rel = data["n_ent"], data["n_rel"]
    log.info("entities %d relations %d train %d", n_ent, n_rel, len(data["train"]))

    g = torch.Generator().manual_seed(0)
    valid = data["valid"][torch.randperm(len(data["valid"]), generator=g)[:args.eval_samples]]
    fk, ft = build_filter_index(torch.cat([data["train"], data["valid"], data["test"]]), n_ent)
    fk, ft = fk.to(device), ft.to(device)

    ds = TensorDataset(data["train"])
    sampler = DistributedSampler(ds, shuffle=True, seed=1234, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.workers, pin_memory=True, drop_last=True)

    model = DistMult(n_ent, n_rel, args.dim).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adagrad(ddp.parameters(), lr=args.lr)

    os.makedirs(args.save_dir, exist_ok=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for step, (x,) in enumerate(loader):
            x = x.to(device, non_blocking=True)
            neg = torch.randint(0, n_ent, (x.size(0), args.neg), device=device)
            pos, negs, reg = ddp(x[:, 0], x[:, 1], x[:, 2], neg)
            loss = F.softplus(-pos).mean() + F.softplus(negs).mean() + args.l2 * reg
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step % 500 == 0:
                log.info("epoch %d step %d/%d loss %.4f", epoch, step, len(loader), loss.item())
        log.info("epoch %d done in %.0fs", epoch, time.time() - t0)

        m = evaluate(model, valid, fk, ft, device, args.eval_chunk)
        log.info("valid %s", m)
        if rank == 0:
            torch.save({"epoch": epoch, "model": model.state_dict(),
                        "optimizer": opt.state_dict(), "metrics": m},
                       os.path.join(args.save_dir, f"epoch{epoch}.pt"))
        dist.barrier()

    m = evaluate(model, data["test"], fk, ft, device, args.eval_chunk)
    log.info("test %s", m)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
