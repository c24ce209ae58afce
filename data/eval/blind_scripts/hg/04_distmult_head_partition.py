"""DistMult with negative sampling on a large KG, data parallel.

Training triples are bucketed by the partition of their head entity (entity ids are
split into `world_size` contiguous ranges, PyTorch-BigGraph style) so that each GPU
mostly touches one slice of the entity table and the sparse rows it updates are
local. Negatives are drawn from the whole entity set.

Launch:
    torchrun --nnodes=1 --nproc_per_node=4 04_distmult_head_partition.py --config configs/distmult_wn18rr.yaml
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
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

DEFAULTS = {
    "data_dir": "data/WN18RR",
    "out_dir": "runs/distmult",
    "dim": 256,
    "neg": 128,
    "batch_size": 512,
    "lr": 5e-4,
    "l2": 1e-6,
    "epochs": 100,
    "num_workers": 4,
    "eval_every": 10,
    "seed": 7,
}


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--override", nargs="*", default=[], help="key=value pairs")
    a = ap.parse_args()
    cfg = dict(DEFAULTS)
    if a.config:
        with open(a.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    for kv in a.override:
        k, v = kv.split("=", 1)
        cfg[k] = type(DEFAULTS[k])(v) if k in DEFAULTS else v
    return argparse.Namespace(**cfg)


def load_ids(data_dir, split):
    # files were converted to integer ids by scripts/prepare_ids.py
    return np.loadtxt(os.path.join(data_dir, f"{split}.ids"), dtype=np.int64, ndmin=2)


def load_counts(data_dir):
    with open(os.path.join(data_dir, "counts.txt")) as f:
        n_ent, n_rel = (int(x) for x in f.read().split())
    return n_ent, n_rel


class NegSampleDataset(Dataset):
    def __init__(self, triples, n_ent, neg):
        self.triples = torch.from_numpy(triples)
        self.n_ent = n_ent
        self.neg = neg

    def __len__(self):
        return len(self.triples)

    def __getitem__(self, i):
        return self.triples[i], torch.randint(0, self.n_ent, (self.neg,))


class DistMult(nn.Module):
    def __init__(self, n_ent, n_rel, dim):
        super().__init__()
        self.E = nn.Embedding(n_ent, dim)
        self.R = nn.Embedding(n_rel, dim)
        nn.init.xavier_uniform_(self.E.weight)
        nn.init.xavier_uniform_(self.R.weight)

    def forward(self, pos, neg):
        h, r, t = self.E(pos[:, 0]), self.R(pos[:, 1]), self.E(pos[:, 2])
        n = self.E(neg)                                   # B x K x d
        pos_score = (h * r * t).sum(-1)
        neg_tail = torch.einsum("bd,bkd->bk", h * r, n)   # (h, r, n)
        neg_head = torch.einsum("bd,bkd->bk", r * t, n)   # (n, r, t)
        reg = h.pow(2).sum() + r.pow(2).sum() + t.pow(2).sum()
        return pos_score, torch.cat([neg_tail, neg_head], dim=1), reg / pos.size(0)

    def all_tail_scores(self, h, r):
        return (self.E(h) * self.R(r)) @ self.E.weight.t()

    def all_head_scores(self, r, t):
        return (self.R(r) * self.E(t)) @ self.E.weight.t()


def head_partition(triples, n_ent, rank, world_size):
    bounds = np.linspace(0, n_ent, world_size + 1).astype(np.int64)
    lo, hi = bounds[rank], bounds[rank + 1]
    mask = (triples[:, 0] >= lo) & (triples[:, 0] < hi)
    return triples[mask]


@torch.no_grad()
def link_prediction(model, triples, all_true, device, rank, world_size, bs=256):
    model.eval()
    sub = triples[rank::world_size]
    totals = torch.zeros(4, device=device)  # rr, h@1, h@10, count
    for i in range(0, len(sub), bs):
        b = torch.from_numpy(sub[i:i + bs]).to(device)
        for side in (0, 2):
            if side == 2:
                scores = model.all_tail_scores(b[:, 0], b[:, 1])
            else:
                scores = model.all_head_scores(b[:, 1], b[:, 2])
            gold = b[:, side]
            gold_score = scores[torch.arange(len(b), device=device), gold].unsqueeze(1)
            for j, (h, r, t) in enumerate(b.tolist()):
                key = (h, r, None) if side == 2 else (None, r, t)
                scores[j, all_true.get(key, [])] = -float("inf")
            rank_ = 1 + (scores > gold_score).sum(1).float()
            totals[0] += (1.0 / rank_).sum()
            totals[1] += (rank_ <= 1).sum()
            totals[2] += (rank_ <= 10).sum()
            totals[3] += len(b)
    dist.all_reduce(totals)
    model.train()
    return {"mrr": (totals[0] / totals[3]).item(), "hits@1": (totals[1] / totals[3]).item(),
            "hits@10": (totals[2] / totals[3]).item()}


def main():
    cfg = load_config()
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s r{rank} %(message)s")
    log = logging.getLogger("distmult")
    if rank != 0:
        log.setLevel(logging.WARNING)

    n_ent, n_rel = load_counts(cfg.data_dir)
    train = load_ids(cfg.data_dir, "train")
    valid = load_ids(cfg.data_dir, "valid")
    test = load_ids(cfg.data_dir, "test")

    all_true = {}
    for h, r, t in np.concatenate([train, valid, test]).tolist():
        all_true.setdefault((h, r, None), []).append(t)
        all_true.setdefault((None, r, t), []).append(h)

    local_train = head_partition(train, n_ent, rank, world_size)
    log.info("rank %d: %d of %d training triples", rank, len(local_train), len(train))
    loader = DataLoader(NegSampleDataset(local_train, n_ent, cfg.neg), batch_size=cfg.batch_size,
                        shuffle=True, num_workers=cfg.num_workers, pin_memory=True, drop_last=True)

    torch.manual_seed(cfg.seed)  # same init everywhere (DDP also broadcasts from rank 0)
    model = DDP(DistMult(n_ent, n_rel, cfg.dim).to(device), device_ids=[local_rank])
    torch.manual_seed(cfg.seed + rank)  # different negatives on each rank
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    os.makedirs(cfg.out_dir, exist_ok=True)

    best = 0.0
    for epoch in range(cfg.epochs):
        t0, tot = time.time(), 0.0
        for pos, neg in loader:
            pos, neg = pos.to(device, non_blocking=True), neg.to(device, non_blocking=True)
            pos_s, neg_s, reg = model(pos, neg)
            loss = F.softplus(-pos_s).mean() + F.softplus(neg_s).mean() + cfg.l2 * reg
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += loss.item()
        log.info("epoch %d  loss %.4f  %.0fs", epoch, tot / max(1, len(loader)), time.time() - t0)

        if (epoch + 1) % cfg.eval_every == 0:
            res = link_prediction(model.module, valid, all_true, device, rank, world_size)
            log.info("valid: %s", res)
            if rank == 0 and res["mrr"] > best:
                best = res["mrr"]
                torch.save(model.module.state_dict(), os.path.join(cfg.out_dir, "best.pt"))
            dist.barrier()

    model.module.load_state_dict(torch.load(os.path.join(cfg.out_dir, "best.pt"), map_location=device))
    log.info("test: %s", link_prediction(model.module, test, all_true, device, rank, world_size))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
