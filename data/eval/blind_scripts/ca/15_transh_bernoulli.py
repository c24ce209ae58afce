"""TransH with Bernoulli negative sampling (Wang et al., 2014) on multiple GPUs.

    torchrun --nproc_per_node=4 15_transh_bernoulli.py --dataset WN18RR --epochs 500
"""
import argparse
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

try:
    import wandb
except ImportError:
    wandb = None


class BernoulliTriples(Dataset):
    """Yields (pos, neg) pairs; corrupts head with prob tph / (tph + hpt) per relation."""

    def __init__(self, triples, n_ent, n_neg):
        self.triples = triples
        self.n_ent = n_ent
        self.n_neg = n_neg
        tails_of, heads_of = defaultdict(set), defaultdict(set)
        for h, r, t in triples:
            tails_of[(h, r)].add(t)
            heads_of[(r, t)].add(h)
        n_rel = int(triples[:, 1].max()) + 1
        tph = np.zeros(n_rel)
        hpt = np.zeros(n_rel)
        cnt_hr = np.zeros(n_rel)
        cnt_rt = np.zeros(n_rel)
        for (h, r), ts in tails_of.items():
            tph[r] += len(ts)
            cnt_hr[r] += 1
        for (r, t), hs in heads_of.items():
            hpt[r] += len(hs)
            cnt_rt[r] += 1
        tph /= np.maximum(cnt_hr, 1)
        hpt /= np.maximum(cnt_rt, 1)
        self.p_head = tph / np.maximum(tph + hpt, 1e-9)

    def __len__(self):
        return len(self.triples)

    def __getitem__(self, i):
        h, r, t = self.triples[i]
        neg = np.tile(self.triples[i], (self.n_neg, 1))
        corrupt_head = np.random.rand(self.n_neg) < self.p_head[r]
        rnd = np.random.randint(0, self.n_ent, self.n_neg)
        neg[corrupt_head, 0] = rnd[corrupt_head]
        neg[~corrupt_head, 2] = rnd[~corrupt_head]
        return torch.from_numpy(self.triples[i].copy()), torch.from_numpy(neg)


class TransH(nn.Module):
    def __init__(self, n_ent, n_rel, dim, margin=4.0, C=0.015):
        super().__init__()
        self.ent = nn.Embedding(n_ent, dim)
        self.rel = nn.Embedding(n_rel, dim)
        self.norm_vec = nn.Embedding(n_rel, dim)
        for e in (self.ent, self.rel, self.norm_vec):
            nn.init.xavier_uniform_(e.weight)
        self.margin, self.C = margin, C

    @staticmethod
    def _project(e, w):
        w = F.normalize(w, p=2, dim=-1)
        return e - (e * w).sum(-1, keepdim=True) * w

    def energy(self, tr):
        w = self.norm_vec(tr[..., 1])
        h = self._project(self.ent(tr[..., 0]), w)
        t = self._project(self.ent(tr[..., 2]), w)
        return (h + self.rel(tr[..., 1]) - t).norm(p=2, dim=-1)

    def forward(self, pos, neg):
        e_pos = self.energy(pos).unsqueeze(1)
        e_neg = self.energy(neg)
        loss = F.relu(self.margin + e_pos - e_neg).mean()
        # soft constraints from the paper
        ent_c = F.relu(self.ent(pos[:, [0, 2]]).norm(dim=-1) ** 2 - 1).mean()
        w = self.norm_vec(pos[:, 1])
        orth = F.relu((w * self.rel(pos[:, 1])).sum(-1) ** 2 / self.rel(pos[:, 1]).norm(dim=-1) ** 2
                      - 1e-4).mean()
        return loss + self.C * (ent_c + orth)

    @torch.no_grad()
    def tail_energy_all(self, h, r):
        w = F.normalize(self.norm_vec(r), dim=-1)                     # [B, d]
        hp = self._project(self.ent(h), w) + self.rel(r)              # [B, d]
        E = self.ent.weight                                           # [N, d]
        Ep = E.unsqueeze(0) - (E @ w.t()).t().unsqueeze(-1) * w.unsqueeze(1)  # [B, N, d]
        return (hp.unsqueeze(1) - Ep).norm(dim=-1)


def read_split(root, name, e2i, r2i):
    rows = [l.strip().split("\t") for l in open(os.path.join(root, name))]
    return np.array([[e2i[h], r2i[r], e2i[t]] for h, r, t in rows], dtype=np.int64)


@torch.no_grad()
def eval_tail(model, triples, known, device, rank, world, bs=16):
    part = triples[rank::world]
    m = torch.zeros(4, device=device, dtype=torch.float64)
    for s in range(0, len(part), bs):
        b = torch.from_numpy(part[s:s + bs]).to(device)
        energy = model.tail_energy_all(b[:, 0], b[:, 1])
        gold = energy.gather(1, b[:, 2:3]).clone()
        for i, (h, r, t) in enumerate(b.tolist()):
            energy[i, list(known[(h, r)])] = float("inf")
        energy.scatter_(1, b[:, 2:3], gold)
        rk = (energy < gold).sum(1).double() + 1
        m[0] += (1 / rk).sum()
        m[1] += (rk <= 3).sum()
        m[2] += (rk <= 10).sum()
        m[3] += rk.numel()
    dist.all_reduce(m)
    return {"mrr": (m[0] / m[3]).item(), "hits@3": (m[1] / m[3]).item(),
            "hits@10": (m[2] / m[3]).item()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", default="WN18RR")
    ap.add_argument("--root", default="data")
    ap.add_argument("--dim", type=int, default=100)
    ap.add_argument("--margin", type=float, default=4.0)
    ap.add_argument("--neg", type=int, default=10)
    ap.add_argument("--bs", type=int, default=1200)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--epochs", type=int, default=500)
    ap.add_argument("--eval_every", type=int, default=50)
    ap.add_argument("--out", default="out/transh")
    ap.add_argument("--wandb_project", default=None)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    root = os.path.join(args.root, args.dataset)
    ents = [l.strip() for l in open(os.path.join(root, "entities.txt"))]
    rels = [l.strip() for l in open(os.path.join(root, "relations.txt"))]
    e2i = {e: i for i, e in enumerate(ents)}
    r2i = {r: i for i, r in enumerate(rels)}
    train = read_split(root, "train.txt", e2i, r2i)
    valid = read_split(root, "valid.txt", e2i, r2i)
    test = read_split(root, "test.txt", e2i, r2i)
    known = defaultdict(set)
    for h, r, t in np.concatenate([train, valid, test]).tolist():
        known[(h, r)].add(t)

    ds = BernoulliTriples(train, len(ents), args.neg)
    loader = DataLoader(ds, batch_size=args.bs, shuffle=True, num_workers=4, pin_memory=True,
                        drop_last=True, persistent_workers=True)

    model = TransH(len(ents), len(rels), args.dim, args.margin).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)

    run = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        if args.wandb_project and wandb is not None:
            run = wandb.init(project=args.wandb_project, config=vars(args))

    best = 0.0
    for epoch in range(args.epochs):
        ddp.train()
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for pos, neg in loader:
            pos, neg = pos.to(device, non_blocking=True), neg.to(device, non_blocking=True)
            loss = ddp(pos, neg)
            opt.zero_grad()
            loss.backward()
            opt.step()
            tot[0] += loss.detach()
            tot[1] += 1
        dist.all_reduce(tot)
        if rank == 0:
            print(f"epoch {epoch} loss {(tot[0] / tot[1]).item():.4f} {time.time() - t0:.1f}s")
            if run:
                run.log({"train/loss": (tot[0] / tot[1]).item()}, step=epoch)

        if (epoch + 1) % args.eval_every == 0:
            model.eval()
            res = eval_tail(model, valid, known, device, rank, world)
            model.train()
            if rank == 0:
                print(f"valid {res}")
                if run:
                    run.log({f"valid/{k}": v for k, v in res.items()}, step=epoch)
                if res["mrr"] > best:
                    best = res["mrr"]
                    torch.save(model.state_dict(), os.path.join(args.out, "best.pt"))
            dist.barrier()

    model.load_state_dict(torch.load(os.path.join(args.out, "best.pt"), map_location=device))
    res = eval_tail(model, test, known, device, rank, world)
    if rank == 0:
        print(f"test {res}")
        if run:
            run.summary.update({f"test/{k}": v for k, v in res.items()})
            run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
