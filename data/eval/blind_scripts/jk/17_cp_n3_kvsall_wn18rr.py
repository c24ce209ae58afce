"""CP decomposition with N3 regularisation, KvsAll training (reciprocal relations), WN18RR.

    torchrun --nproc_per_node=4 17_cp_n3_kvsall_wn18rr.py --data data/WN18RR --out runs/cp_wn18rr
"""
import argparse
import functools
import json
import logging
import os
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

LOG = logging.getLogger("cp")


def options():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data/WN18RR")
    p.add_argument("--out", default="runs/cp_wn18rr")
    p.add_argument("--rank", type=int, default=2000, help="CP rank")
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--n3", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--eval_every", type=int, default=5)
    p.add_argument("--eval_batch", type=int, default=500)
    return p.parse_args()


class KvsAll(Dataset):
    """One item per (subject, relation) pair with the set of all training objects."""

    def __init__(self, sr2o):
        self.keys = sorted(sr2o)
        self.objs = [torch.tensor(sorted(sr2o[k])) for k in self.keys]

    def __len__(self):
        return len(self.keys)

    def __getitem__(self, i):
        return torch.tensor(self.keys[i]), self.objs[i]


def kvsall_collate(batch, n_ent):
    sr = torch.stack([b[0] for b in batch])
    y = torch.zeros(len(batch), n_ent)
    for i, (_, objs) in enumerate(batch):
        y[i, objs] = 1.0
    return sr, y


class CP(nn.Module):
    def __init__(self, n_ent, n_rel, rank, init=1e-3):
        super().__init__()
        self.lhs = nn.Embedding(n_ent, rank)
        self.rel = nn.Embedding(n_rel, rank)
        self.rhs = nn.Embedding(n_ent, rank)
        for e in (self.lhs, self.rel, self.rhs):
            e.weight.data *= init

    def forward(self, s, r):
        a, b = self.lhs(s), self.rel(r)
        scores = (a * b) @ self.rhs.weight.t()
        return scores, (a, b)

    @torch.no_grad()
    def predict(self, s, r):
        return (self.lhs(s) * self.rel(r)) @ self.rhs.weight.t()


def n3(factors):
    return sum(f.abs().pow(3).sum() for f in factors) / factors[0].size(0)


@torch.no_grad()
def link_prediction(model, loader, sr2o_all, device):
    model.eval()
    ranks = []
    for (q,) in loader:
        q = q.to(device)
        scores = model.predict(q[:, 0], q[:, 1])
        gold = scores.gather(1, q[:, 2:3])
        for i, (s, r) in enumerate(q[:, :2].tolist()):
            scores[i, sr2o_all[(s, r)]] = -float("inf")
        ranks.append(1 + (scores > gold).sum(1))
    ranks = torch.cat(ranks).double()
    return {"MRR": (1 / ranks).mean().item(), "MR": ranks.mean().item(),
            "H@1": (ranks <= 1).double().mean().item(), "H@3": (ranks <= 3).double().mean().item(),
            "H@10": (ranks <= 10).double().mean().item()}


def main():
    args = options()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")

    def read_dict(name):
        with open(os.path.join(args.data, name)) as f:
            return {k: int(v) for v, k in (l.rstrip("\n").split("\t") for l in f)}

    e2i, r2i = read_dict("entities.dict"), read_dict("relations.dict")
    n_ent, n_rel = len(e2i), len(r2i)
    splits = {}
    for s in ("train", "valid", "test"):
        with open(os.path.join(args.data, f"{s}.txt")) as f:
            x = torch.tensor([[e2i[h], r2i[r], e2i[t]] for h, r, t in (l.rstrip("\n").split("\t") for l in f)])
        splits[s] = torch.cat([x, torch.stack([x[:, 2], x[:, 1] + n_rel, x[:, 0]], 1)])  # + reciprocals

    sr2o_train, sr2o_all = defaultdict(set), defaultdict(list)
    for s, r, o in splits["train"].tolist():
        sr2o_train[(s, r)].add(o)
    for split in splits.values():
        for s, r, o in split.tolist():
            sr2o_all[(s, r)].append(o)

    train_ds = KvsAll(sr2o_train)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch, sampler=train_sampler, num_workers=4,
                              collate_fn=functools.partial(kvsall_collate, n_ent=n_ent), pin_memory=True)
    eval_loaders = {}
    for s in ("valid", "test"):
        ds = TensorDataset(splits[s])
        eval_loaders[s] = DataLoader(ds, batch_size=args.eval_batch,
                                     sampler=DistributedSampler(ds, shuffle=False))

    model = CP(n_ent, 2 * n_rel, args.rank).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adagrad(ddp.parameters(), lr=args.lr)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    LOG.info("%d entities, %d relations (x2 with reciprocals), %d (s,r) training queries",
             n_ent, n_rel, len(train_ds))

    best = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        ddp.train()
        t0 = time.time()
        stats = torch.zeros(2, device=device)
        for sr, y in train_loader:
            sr, y = sr.to(device, non_blocking=True), y.to(device, non_blocking=True)
            scores, factors = ddp(sr[:, 0], sr[:, 1])
            fit = F.binary_cross_entropy_with_logits(scores, y)
            loss = fit + args.n3 * n3(factors)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            stats += torch.stack([fit.detach(), torch.ones((), device=device)])
        dist.all_reduce(stats)
        LOG.info("epoch %d: bce %.5f, %.1fs", epoch + 1, (stats[0] / stats[1]).item(), time.time() - t0)

        if (epoch + 1) % args.eval_every == 0:
            m = link_prediction(model, eval_loaders["valid"], sr2o_all, device)
            if rank == 0:
                LOG.info("epoch %d valid %s", epoch + 1, json.dumps({k: round(v, 4) for k, v in m.items()}))
                if m["MRR"] > best:
                    best = m["MRR"]
                    torch.save({"epoch": epoch + 1, "model": model.state_dict(), "valid": m},
                               os.path.join(args.out, "best.pt"))
            dist.barrier()

    ckpt = torch.load(os.path.join(args.out, "best.pt"), map_location=device)
    model.load_state_dict(ckpt["model"])
    m = link_prediction(model, eval_loaders["test"], sr2o_all, device)
    if rank == 0:
        LOG.info("test (epoch %d): %s", ckpt["epoch"], json.dumps({k: round(v, 4) for k, v in m.items()}))
        with open(os.path.join(args.out, "test.json"), "w") as f:
            json.dump(m, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
