"""MuRE (Balazevic et al., NeurIPS 2019), Euclidean multi-relational embeddings.

score(h, r, t) = -||R_r * e_h - (e_t + r)||^2 + b_h + b_t

Multi-GPU DDP training with bf16 autocast, 1-vs-many negatives, cosine LR.

    torchrun --nproc_per_node=8 15_mure_bf16.py --data data/WN18RR --dim 200 --epochs 500
"""
import argparse
import logging
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("mure")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/WN18RR")
    ap.add_argument("--out", default="runs/mure")
    ap.add_argument("--dim", type=int, default=200)
    ap.add_argument("--nneg", type=int, default=50)
    ap.add_argument("--batch_size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=50.0)
    ap.add_argument("--epochs", type=int, default=500)
    ap.add_argument("--eval_every", type=int, default=20)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def load_data(root):
    ents, rels = {}, {}
    out = {}
    for split in ("train", "valid", "test"):
        rows = []
        with open(os.path.join(root, f"{split}.txt")) as f:
            for line in f:
                h, r, t = line.strip().split()
                rows.append((ents.setdefault(h, len(ents)), rels.setdefault(r, len(rels)),
                             ents.setdefault(t, len(ents))))
        out[split] = np.asarray(rows, dtype=np.int64)
    # reciprocal triples so that head prediction is tail prediction of r^-1
    n_rel = len(rels)
    for split in list(out):
        tri = out[split]
        inv = np.stack([tri[:, 2], tri[:, 1] + n_rel, tri[:, 0]], axis=1)
        out[split] = np.concatenate([tri, inv])
    return out, len(ents), 2 * n_rel


class MultiNeg(Dataset):
    def __init__(self, triples, n_ent, nneg):
        self.tri, self.n_ent, self.nneg = triples, n_ent, nneg

    def __len__(self):
        return len(self.tri)

    def __getitem__(self, i):
        h, r, t = self.tri[i]
        tails = np.concatenate([[t], np.random.randint(0, self.n_ent, self.nneg)])
        return h, r, torch.from_numpy(tails)


class MuRE(nn.Module):
    def __init__(self, n_ent, n_rel, dim):
        super().__init__()
        self.E = nn.Embedding(n_ent, dim)
        self.E.weight.data = 1e-3 * torch.randn(n_ent, dim)
        self.Wu = nn.Parameter(torch.empty(n_rel, dim).uniform_(-1, 1))
        self.rvh = nn.Embedding(n_rel, dim)
        self.rvh.weight.data = 1e-3 * torch.randn(n_rel, dim)
        self.bs = nn.Parameter(torch.zeros(n_ent))
        self.bo = nn.Parameter(torch.zeros(n_ent))

    def forward(self, h, r, tails):
        u = self.E(h)                       # B x d
        Ru = self.Wu[r]                     # B x d
        rv = self.rvh(r)                    # B x d
        v = self.E(tails)                   # B x K x d
        u_w = (u * Ru).unsqueeze(1)
        dist_sq = ((u_w - (v + rv.unsqueeze(1))) ** 2).sum(-1)
        return -dist_sq + self.bs[h].unsqueeze(1) + self.bo[tails]

    @torch.no_grad()
    def score_all(self, h, r):
        u_w = self.E(h) * self.Wu[r]
        shift = self.rvh(r)
        q = u_w - shift
        # ||q - v||^2 for all v without materialising B x N x d
        d2 = (q ** 2).sum(-1, keepdim=True) - 2 * q @ self.E.weight.t() + (self.E.weight ** 2).sum(-1)
        return -d2 + self.bs[h].unsqueeze(1) + self.bo.unsqueeze(0)


@torch.no_grad()
def evaluate(model, triples, known, device, rank, world, bs=512):
    sub = triples[rank::world]
    agg = torch.zeros(5, device=device, dtype=torch.float64)
    for i in range(0, len(sub), bs):
        b = torch.from_numpy(sub[i:i + bs]).to(device)
        s = model.score_all(b[:, 0], b[:, 1]).float()
        gold = s.gather(1, b[:, 2:3])
        for j, (h, r, _) in enumerate(b.tolist()):
            s[j, known[(h, r)]] = -math.inf
        rk = (s > gold).sum(1).double() + 1
        agg += torch.stack([(1 / rk).sum(), (rk <= 1).sum().double(), (rk <= 3).sum().double(),
                            (rk <= 10).sum().double(), rk.new_tensor(len(rk))])
    dist.all_reduce(agg)
    return {k: (agg[i] / agg[4]).item() for i, k in enumerate(["mrr", "h1", "h3", "h10"])}


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")

    data, n_ent, n_rel = load_data(args.data)
    known = {}
    for h, r, t in np.concatenate([data["train"], data["valid"], data["test"]]).tolist():
        known.setdefault((h, r), []).append(t)

    ds = MultiNeg(data["train"], n_ent, args.nneg)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    torch.manual_seed(args.seed)
    model = MuRE(n_ent, n_rel, args.dim).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    torch.manual_seed(args.seed + rank)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))
    target = torch.zeros(args.batch_size, args.nneg + 1, device=device)
    target[:, 0] = 1.0

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    logger.info("%d entities, %d relations (with inverses), %d train examples, %d steps/epoch",
                n_ent, n_rel, len(ds), len(loader))

    best = 0.0
    for epoch in range(1, args.epochs + 1):
        ddp.train()
        t0 = time.time()
        losses = []
        for h, r, tails in loader:
            h, r, tails = h.to(device), r.to(device), tails.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = ddp(h, r, tails)
            loss = F.binary_cross_entropy_with_logits(logits.float(), target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.detach())
        mean_loss = torch.stack(losses).mean()
        dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
        logger.info("epoch %d loss %.5f lr %.3f %.1fs", epoch, mean_loss.item(), sched.get_last_lr()[0],
                    time.time() - t0)

        if epoch % args.eval_every == 0:
            model.eval()
            res = evaluate(model, data["valid"], known, device, rank, world)
            logger.info("epoch %d valid %s", epoch, res)
            if rank == 0 and res["mrr"] > best:
                best = res["mrr"]
                torch.save({"epoch": epoch, "model": model.state_dict()}, os.path.join(args.out, "best.pt"))
            dist.barrier()

    model.load_state_dict(torch.load(os.path.join(args.out, "best.pt"), map_location=device)["model"])
    model.eval()
    logger.info("test %s", evaluate(model, data["test"], known, device, rank, world))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
