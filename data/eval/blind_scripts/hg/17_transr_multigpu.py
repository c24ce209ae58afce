"""TransR (Lin et al., AAAI 2015): entities and relations in separate spaces.

Entities are projected into each relation's space with a d_e x d_r matrix M_r.
Entity / relation vectors are initialised from a pretrained TransE run, as in the paper.

    torchrun --nproc_per_node=4 17_transr_multigpu.py --data data/FB15k-237 --transe_init runs/transe/best.pt
"""
import argparse
import logging
import os
import time
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DEVICE = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
logger = logging.getLogger("transr")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--transe_init", default=None, help="checkpoint of a TransE run with the same vocab")
    ap.add_argument("--out", default="runs/transr")
    ap.add_argument("--ent_dim", type=int, default=100)
    ap.add_argument("--rel_dim", type=int, default=100)
    ap.add_argument("--margin", type=float, default=4.0)
    ap.add_argument("--neg", type=int, default=16)
    ap.add_argument("--batch_size", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--eval_every", type=int, default=30)
    return ap.parse_args()


def load(data):
    def vocab(fn):
        with open(os.path.join(data, fn)) as f:
            return {n: int(i) for i, n in (l.rstrip("\n").split("\t") for l in f)}

    e2i, r2i = vocab("entities.dict"), vocab("relations.dict")
    out = {}
    for s in ("train", "valid", "test"):
        with open(os.path.join(data, f"{s}.txt")) as f:
            out[s] = np.array([(e2i[h], r2i[r], e2i[t]) for h, r, t in
                               (l.rstrip("\n").split("\t") for l in f)], dtype=np.int64)
    return out, len(e2i), len(r2i)


class Corrupt(Dataset):
    def __init__(self, triples, n_ent, k):
        self.triples, self.n_ent, self.k = triples, n_ent, k

    def __len__(self):
        return len(self.triples)

    def __getitem__(self, i):
        pos = torch.from_numpy(self.triples[i])
        neg = pos.repeat(self.k, 1)
        ents = torch.randint(self.n_ent, (self.k,))
        head = torch.rand(self.k) < 0.5
        neg[head, 0] = ents[head]
        neg[~head, 2] = ents[~head]
        return pos, neg


class TransR(nn.Module):
    def __init__(self, n_ent, n_rel, ent_dim, rel_dim):
        super().__init__()
        self.ent = nn.Embedding(n_ent, ent_dim)
        self.rel = nn.Embedding(n_rel, rel_dim)
        self.proj = nn.Embedding(n_rel, ent_dim * rel_dim)
        nn.init.xavier_uniform_(self.ent.weight)
        nn.init.xavier_uniform_(self.rel.weight)
        eye = torch.eye(ent_dim, rel_dim).flatten()
        self.proj.weight.data.copy_(eye.expand(n_rel, -1))
        self.ent_dim, self.rel_dim = ent_dim, rel_dim

    def _project(self, e, r):
        M = self.proj(r).view(*r.shape, self.ent_dim, self.rel_dim)
        return F.normalize(torch.matmul(e.unsqueeze(-2), M).squeeze(-2), p=2, dim=-1)

    def distance(self, trip):
        h, r, t = trip[..., 0], trip[..., 1], trip[..., 2]
        hp = self._project(F.normalize(self.ent(h), dim=-1), r)
        tp = self._project(F.normalize(self.ent(t), dim=-1), r)
        return (hp + F.normalize(self.rel(r), dim=-1) - tp).norm(p=1, dim=-1)

    def forward(self, pos, neg):
        return self.distance(pos), self.distance(neg)

    @torch.no_grad()
    def tail_distances(self, h, r):
        M = self.proj(r).view(-1, self.ent_dim, self.rel_dim)                 # B x de x dr
        q = self._project(F.normalize(self.ent(h), dim=-1), r) + F.normalize(self.rel(r), dim=-1)
        all_e = F.normalize(self.ent.weight, dim=-1)                          # N x de
        proj_all = F.normalize(torch.einsum("nd,bdk->bnk", all_e, M), dim=-1)  # B x N x dr
        return (q.unsqueeze(1) - proj_all).norm(p=1, dim=-1)


@torch.no_grad()
def evaluate(model, triples, known, rank, world, bs=16):
    part = triples[rank::world]
    acc = torch.zeros(3, device=DEVICE, dtype=torch.float64)
    for i in range(0, len(part), bs):
        b = torch.from_numpy(part[i:i + bs]).to(DEVICE)
        d = model.tail_distances(b[:, 0], b[:, 1])
        gold = d.gather(1, b[:, 2:3])
        for j, (h, r, _) in enumerate(b.tolist()):
            d[j, known[(h, r)]] = float("inf")
        rk = (d < gold).sum(1).double() + 1
        acc += torch.stack([(1 / rk).sum(), (rk <= 10).sum().double(), rk.new_tensor(len(rk))])
    dist.all_reduce(acc)
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")

    data, n_ent, n_rel = load(args.data)
    known = defaultdict(list)
    for h, r, t in np.concatenate(list(data.values())).tolist():
        known[(h, r)].append(t)

    model = TransR(n_ent, n_rel, args.ent_dim, args.rel_dim)
    if args.transe_init:
        sd = torch.load(args.transe_init, map_location="cpu")["model"]
        model.ent.weight.data.copy_(sd["ent.weight"])
        model.rel.weight.data.copy_(sd["rel.weight"])
        logger.info("initialised entity/relation vectors from %s", args.transe_init)
    model.to(DEVICE)
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(ddp.parameters(), lr=args.lr)

    ds = Corrupt(data["train"], n_ent, args.neg)
    sampler = DistributedSampler(ds, shuffle=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=4, pin_memory=True)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = 0.0
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        t0, run = time.time(), torch.zeros(2, device=DEVICE)
        for pos, neg in loader:
            pos, neg = pos.to(DEVICE), neg.to(DEVICE)
            dp, dn = ddp(pos, neg)
            loss = F.relu(args.margin + dp.unsqueeze(1) - dn).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            run += torch.stack([loss.detach(), torch.ones((), device=DEVICE)])
        dist.all_reduce(run)
        logger.info("epoch %d loss %.4f (%.0fs)", epoch, (run[0] / run[1]).item(), time.time() - t0)

        if epoch % args.eval_every == 0:
            model.eval()
            mrr, h10 = evaluate(model, data["valid"], known, rank, world)
            model.train()
            logger.info("epoch %d valid MRR %.4f Hits@10 %.4f", epoch, mrr, h10)
            if rank == 0 and mrr > best:
                best = mrr
                torch.save({"epoch": epoch, "model": model.state_dict()}, os.path.join(args.out, "best.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
