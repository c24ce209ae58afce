#!/usr/bin/env python
"""ComplEx with negative sampling and binary cross entropy (Trouillon et al. 2016).

    torchrun --standalone --nproc_per_node=4 06_complex_negsample.py --dataset data/YAGO3-10
"""
import argparse
import json
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
from tqdm import tqdm


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", required=True)
    p.add_argument("--out", default="out/complex")
    p.add_argument("--dim", type=int, default=200)
    p.add_argument("--neg_ratio", type=int, default=50)
    p.add_argument("--batch", type=int, default=2000)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--lmbda", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--eval_every", type=int, default=10)
    p.add_argument("--workers", type=int, default=4)
    return p.parse_args()


def read_kg(root):
    ents, rels = {}, {}

    def idx(d, k):
        if k not in d:
            d[k] = len(d)
        return d[k]

    data = {}
    for split in ("train", "valid", "test"):
        rows = []
        with open(os.path.join(root, f"{split}.txt")) as f:
            for line in f:
                h, r, t = line.strip().split("\t")
                rows.append((idx(ents, h), idx(rels, r), idx(ents, t)))
        data[split] = np.array(rows, dtype=np.int64)
    return data, ents, rels


class KGTrain(Dataset):
    def __init__(self, triples, n_ent, neg_ratio):
        self.x = triples
        self.n_ent = n_ent
        self.neg_ratio = neg_ratio

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        pos = self.x[i]
        neg = np.repeat(pos[None], self.neg_ratio, axis=0)
        ids = np.random.randint(0, self.n_ent, self.neg_ratio)
        side = np.random.rand(self.neg_ratio) < 0.5
        neg[side, 0] = ids[side]
        neg[~side, 2] = ids[~side]
        trip = np.concatenate([pos[None], neg])
        lab = np.zeros(len(trip), dtype=np.float32)
        lab[0] = 1.0
        return torch.from_numpy(trip), torch.from_numpy(lab)


class ComplEx(nn.Module):
    def __init__(self, n_ent, n_rel, dim):
        super().__init__()
        self.ent_re = nn.Embedding(n_ent, dim)
        self.ent_im = nn.Embedding(n_ent, dim)
        self.rel_re = nn.Embedding(n_rel, dim)
        self.rel_im = nn.Embedding(n_rel, dim)
        for e in (self.ent_re, self.ent_im, self.rel_re, self.rel_im):
            nn.init.xavier_normal_(e.weight)

    def forward(self, trip):
        h, r, t = trip[..., 0], trip[..., 1], trip[..., 2]
        hr, hi = self.ent_re(h), self.ent_im(h)
        rr, ri = self.rel_re(r), self.rel_im(r)
        tr, ti = self.ent_re(t), self.ent_im(t)
        score = (hr * rr * tr + hi * rr * ti + hr * ri * ti - hi * ri * tr).sum(-1)
        reg = (hr ** 2 + hi ** 2 + rr ** 2 + ri ** 2 + tr ** 2 + ti ** 2).sum(-1).mean()
        return score, reg

    def tail_scores(self, h, r):
        hr, hi = self.ent_re(h), self.ent_im(h)
        rr, ri = self.rel_re(r), self.rel_im(r)
        return (hr * rr - hi * ri) @ self.ent_re.weight.t() + (hi * rr + hr * ri) @ self.ent_im.weight.t()

    def head_scores(self, r, t):
        tr, ti = self.ent_re(t), self.ent_im(t)
        rr, ri = self.rel_re(r), self.rel_im(r)
        return (rr * tr + ri * ti) @ self.ent_re.weight.t() + (rr * ti - ri * tr) @ self.ent_im.weight.t()


def build_index(data):
    sr2o, or2s = {}, {}
    for h, r, t in np.concatenate(list(data.values())).tolist():
        sr2o.setdefault((h, r), set()).add(t)
        or2s.setdefault((t, r), set()).add(h)
    return {k: list(v) for k, v in sr2o.items()}, {k: list(v) for k, v in or2s.items()}


@torch.no_grad()
def evaluate(model, triples, sr2o, or2s, device, rank, world, bs=512):
    model.eval()
    mine = triples[rank::world]
    mrr, h1, h3, h10, n = 0.0, 0.0, 0.0, 0.0, 0
    it = range(0, len(mine), bs)
    for i in tqdm(it, disable=rank != 0, desc="eval", leave=False):
        b = torch.from_numpy(mine[i:i + bs]).to(device)
        for pred_tail in (True, False):
            if pred_tail:
                s, gold = model.tail_scores(b[:, 0], b[:, 1]), b[:, 2]
                filt = [sr2o[(h, r)] for h, r, _ in b.tolist()]
            else:
                s, gold = model.head_scores(b[:, 1], b[:, 2]), b[:, 0]
                filt = [or2s[(t, r)] for _, r, t in b.tolist()]
            g = s[torch.arange(len(b), device=device), gold].clone()
            for j, f in enumerate(filt):
                s[j, f] = -1e9
            ranks = (s > g[:, None]).sum(1).cpu().numpy() + 1
            mrr += (1.0 / ranks).sum()
            h1 += (ranks <= 1).sum()
            h3 += (ranks <= 3).sum()
            h10 += (ranks <= 10).sum()
            n += len(ranks)
    tot = torch.tensor([mrr, h1, h3, h10, n], dtype=torch.float64)
    dist.all_reduce(tot, op=dist.ReduceOp.SUM)
    mrr, h1, h3, h10, n = tot.tolist()
    model.train()
    return dict(mrr=mrr / n, hits1=h1 / n, hits3=h3 / n, hits10=h10 / n)


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    lr_ = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(lr_)
    device = torch.device("cuda", lr_)

    data, ents, rels = read_kg(args.dataset)
    sr2o, or2s = build_index(data)
    if rank == 0:
        print(f"{len(ents)} entities, {len(rels)} relations, {len(data['train'])} train triples", flush=True)
        os.makedirs(args.out, exist_ok=True)

    ds = KGTrain(data["train"], len(ents), args.neg_ratio)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch // (args.neg_ratio + 1), sampler=sampler,
                        num_workers=args.workers, pin_memory=True, persistent_workers=True)

    model = ComplEx(len(ents), len(rels), args.dim).to(device)
    model = DDP(model, device_ids=[lr_])
    opt = torch.optim.Adagrad(model.parameters(), lr=args.lr)

    history, best = [], -1.0
    for ep in range(1, args.epochs + 1):
        sampler.set_epoch(ep)
        t0 = time.time()
        ep_loss = torch.zeros((), device=device)
        for trip, lab in loader:
            trip = trip.to(device, non_blocking=True)
            lab = lab.to(device, non_blocking=True)
            score, reg = model(trip)
            loss = F.binary_cross_entropy_with_logits(score, lab) + args.lmbda * reg
            opt.zero_grad()
            loss.backward()
            opt.step()
            ep_loss += loss.detach()
        dist.all_reduce(ep_loss)
        if rank == 0:
            print(f"ep {ep:4d} loss {ep_loss.item() / (world * len(loader)):.4f} ({time.time() - t0:.1f}s)", flush=True)

        if ep % args.eval_every == 0:
            res = evaluate(model.module, data["valid"], sr2o, or2s, device, rank, world)
            if rank == 0:
                res["epoch"] = ep
                history.append(res)
                print("valid", json.dumps(res), flush=True)
                if res["mrr"] > best:
                    best = res["mrr"]
                    torch.save(model.module.state_dict(), os.path.join(args.out, "best_model.pt"))
                with open(os.path.join(args.out, "history.json"), "w") as f:
                    json.dump(history, f, indent=1)
            dist.barrier()

    sd = torch.load(os.path.join(args.out, "best_model.pt"), map_location=device)
    model.module.load_state_dict(sd)
    res = evaluate(model.module, data["test"], sr2o, or2s, device, rank, world)
    if rank == 0:
        print("test", json.dumps(res), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
