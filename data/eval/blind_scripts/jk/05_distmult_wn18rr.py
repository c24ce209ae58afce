"""DistMult with uniform negative sampling and softplus loss on WN18RR.

    torchrun --nproc_per_node=4 05_distmult_wn18rr.py --data data/WN18RR --out runs/distmult_wn18rr
"""
import argparse
import dataclasses
import json
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset


@dataclass
class Config:
    data: str = "data/WN18RR"
    out: str = "runs/distmult_wn18rr"
    dim: int = 256
    neg: int = 128
    batch_size: int = 1024
    lr: float = 3e-3
    weight_decay: float = 0.0
    l3: float = 1e-4
    epochs: int = 150
    eval_every: int = 10
    eval_batch: int = 256
    workers: int = 4
    seed: int = 17


def parse_config():
    cfg = Config()
    ap = argparse.ArgumentParser()
    for f in dataclasses.fields(cfg):
        ap.add_argument(f"--{f.name}", type=type(f.default), default=f.default)
    return Config(**vars(ap.parse_args()))


class KG:
    def __init__(self, root):
        self.ent2id = self._read_dict(os.path.join(root, "entities.dict"))
        self.rel2id = self._read_dict(os.path.join(root, "relations.dict"))
        self.splits = {s: self._read_triples(os.path.join(root, f"{s}.txt")) for s in ("train", "valid", "test")}
        self.num_ent, self.num_rel = len(self.ent2id), len(self.rel2id)
        known = np.concatenate(list(self.splits.values()))
        self.hr_t, self.rt_h = {}, {}
        for h, r, t in known.tolist():
            self.hr_t.setdefault((h, r), set()).add(t)
            self.rt_h.setdefault((r, t), set()).add(h)

    @staticmethod
    def _read_dict(path):
        with open(path) as f:
            return {k: int(v) for v, k in (line.rstrip("\n").split("\t") for line in f)}

    def _read_triples(self, path):
        with open(path) as f:
            rows = [line.rstrip("\n").split("\t") for line in f]
        return np.array([[self.ent2id[h], self.rel2id[r], self.ent2id[t]] for h, r, t in rows], dtype=np.int64)


class NegSampleDataset(Dataset):
    def __init__(self, triples, num_ent, neg):
        self.triples = torch.as_tensor(triples)
        self.num_ent, self.neg = num_ent, neg

    def __len__(self):
        return len(self.triples)

    def __getitem__(self, i):
        h, r, t = self.triples[i]
        corrupt = torch.randint(0, self.num_ent, (self.neg,))
        if torch.rand(1).item() < 0.5:
            heads, tails = corrupt, t.expand(self.neg)
        else:
            heads, tails = h.expand(self.neg), corrupt
        return self.triples[i], torch.stack([heads, r.expand(self.neg), tails], dim=1)


class DistMult(nn.Module):
    def __init__(self, num_ent, num_rel, dim):
        super().__init__()
        self.E = nn.Embedding(num_ent, dim)
        self.R = nn.Embedding(num_rel, dim)
        nn.init.xavier_uniform_(self.E.weight)
        nn.init.xavier_uniform_(self.R.weight)

    def score(self, h, r, t):
        return (self.E(h) * self.R(r) * self.E(t)).sum(-1)

    def forward(self, pos, neg):
        ps = self.score(pos[:, 0], pos[:, 1], pos[:, 2])
        ns = self.score(neg[..., 0], neg[..., 1], neg[..., 2])
        reg = (self.E(pos[:, 0]).abs().pow(3).sum() + self.R(pos[:, 1]).abs().pow(3).sum()
               + self.E(pos[:, 2]).abs().pow(3).sum()) / pos.size(0)
        return ps, ns, reg

    def all_tails(self, h, r):
        return (self.E(h) * self.R(r)) @ self.E.weight.t()

    def all_heads(self, r, t):
        return (self.R(r) * self.E(t)) @ self.E.weight.t()


@torch.no_grad()
def link_prediction(model, triples, kg, rank, world, device, bs):
    model.eval()
    mine = triples[rank::world]
    tot = torch.zeros(6, device=device, dtype=torch.float64)  # rr, mr, h1, h3, h10, n
    for s in range(0, len(mine), bs):
        b = torch.as_tensor(mine[s:s + bs], device=device)
        for side in ("tail", "head"):
            if side == "tail":
                scores = model.all_tails(b[:, 0], b[:, 1])
                gold = b[:, 2]
                filt = [kg.hr_t[(h, r)] for h, r in b[:, :2].tolist()]
            else:
                scores = model.all_heads(b[:, 1], b[:, 2])
                gold = b[:, 0]
                filt = [kg.rt_h[(r, t)] for r, t in b[:, 1:].tolist()]
            gold_score = scores.gather(1, gold[:, None])
            mask = torch.zeros_like(scores, dtype=torch.bool)
            for i, f in enumerate(filt):
                mask[i, list(f)] = True
            scores.masked_fill_(mask, float("-inf"))
            rk = (scores > gold_score).sum(1).double() + 1
            tot += torch.stack([(1 / rk).sum(), rk.sum(), (rk <= 1).sum().double(), (rk <= 3).sum().double(),
                                (rk <= 10).sum().double(), torch.tensor(rk.numel(), device=device, dtype=torch.float64)])
    dist.all_reduce(tot)
    n = tot[5]
    return {"MRR": (tot[0] / n).item(), "MR": (tot[1] / n).item(), "H@1": (tot[2] / n).item(),
            "H@3": (tot[3] / n).item(), "H@10": (tot[4] / n).item()}


def main():
    cfg = parse_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)
    main_proc = rank == 0

    kg = KG(cfg.data)
    train_ds = NegSampleDataset(kg.splits["train"], kg.num_ent, cfg.neg)
    loader = DataLoader(train_ds, batch_size=cfg.batch_size, shuffle=True, num_workers=cfg.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = DistMult(kg.num_ent, kg.num_rel, cfg.dim).to(device)
    model = DDP(model, device_ids=[local_rank])
    optim = torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=cfg.epochs)

    if main_proc:
        os.makedirs(cfg.out, exist_ok=True)
        with open(os.path.join(cfg.out, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(cfg), f, indent=2)
        print(f"{kg.num_ent} entities / {kg.num_rel} relations, {len(train_ds)} train triples, "
              f"{len(loader)} steps per epoch per rank, {world} ranks", flush=True)

    best_mrr, history = 0.0, []
    for epoch in range(1, cfg.epochs + 1):
        model.train()
        start = time.perf_counter()
        running = torch.zeros(2, device=device)
        for pos, neg in loader:
            pos = pos.to(device, non_blocking=True)
            neg = neg.to(device, non_blocking=True)
            ps, ns, reg = model(pos, neg)
            loss = F.softplus(-ps).mean() + F.softplus(ns).mean() + cfg.l3 * reg
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            running[0] += loss.detach()
            running[1] += 1
        sched.step()
        dist.all_reduce(running)
        if main_proc:
            print(f"[{epoch:03d}] loss={running[0].item() / running[1].item():.4f} "
                  f"lr={sched.get_last_lr()[0]:.2e} t={time.perf_counter() - start:.1f}s", flush=True)

        if epoch % cfg.eval_every == 0:
            res = link_prediction(model.module, kg.splits["valid"], kg, rank, world, device, cfg.eval_batch)
            history.append({"epoch": epoch, **res})
            if main_proc:
                print(f"      valid {res}", flush=True)
                if res["MRR"] > best_mrr:
                    best_mrr = res["MRR"]
                    torch.save({"epoch": epoch, "model": model.module.state_dict(),
                                "optim": optim.state_dict(), "sched": sched.state_dict()},
                               os.path.join(cfg.out, "best.pt"))
            dist.barrier()

    ckpt = torch.load(os.path.join(cfg.out, "best.pt"), map_location="cpu")
    model.module.load_state_dict(ckpt["model"])
    res = link_prediction(model.module, kg.splits["test"], kg, rank, world, device, cfg.eval_batch)
    if main_proc:
        print(f"test (epoch {ckpt['epoch']}): {res}", flush=True)
        with open(os.path.join(cfg.out, "results.json"), "w") as f:
            json.dump({"valid_history": history, "test": res}, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
