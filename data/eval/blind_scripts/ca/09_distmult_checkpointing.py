"""DistMult / relation-partitioned negatives, multi-GPU.

Negatives are drawn from entities that actually occur with the relation
(type-constrained sampling), which helps a lot on CoDEx / YAGO-style KGs.

    torchrun --nproc_per_node=4 09_distmult_checkpointing.py --dataset codex-l --exp_dir exp/dm_codexl
"""
import argparse
import os
import shutil
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
from torch.utils.tensorboard import SummaryWriter


def args_():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", default="codex-l")
    p.add_argument("--data_root", default="data")
    p.add_argument("--exp_dir", required=True)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--batch_size", type=int, default=1024)
    p.add_argument("--negatives", type=int, default=100)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=150)
    p.add_argument("--patience", type=int, default=5)
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


class KG:
    def __init__(self, root):
        self.ent = {l.split("\t")[0]: i for i, l in enumerate(open(os.path.join(root, "entities.tsv")))}
        self.rel = {l.split("\t")[0]: i for i, l in enumerate(open(os.path.join(root, "relations.tsv")))}
        self.splits = {s: self._read(os.path.join(root, f"{s}.txt")) for s in ("train", "valid", "test")}

    def _read(self, fn):
        rows = [l.strip().split("\t") for l in open(fn)]
        return np.array([[self.ent[h], self.rel[r], self.ent[t]] for h, r, t in rows], dtype=np.int64)


class TypedNegatives(Dataset):
    """Each item: positive triple + k corrupted tails drawn from the relation's range."""

    def __init__(self, triples, n_ent, k):
        self.triples = triples
        self.k = k
        rng = defaultdict(set)
        for _, r, t in triples:
            rng[int(r)].add(int(t))
        self.range = {r: np.fromiter(s, dtype=np.int64) for r, s in rng.items()}
        self.n_ent = n_ent

    def __len__(self):
        return len(self.triples)

    def __getitem__(self, i):
        h, r, t = self.triples[i]
        cand = self.range[int(r)]
        if len(cand) > 1:
            neg = cand[np.random.randint(0, len(cand), size=self.k)]
        else:
            neg = np.random.randint(0, self.n_ent, size=self.k)
        return torch.from_numpy(self.triples[i]), torch.from_numpy(neg)


class DistMult(nn.Module):
    def __init__(self, n_ent, n_rel, dim, dropout):
        super().__init__()
        self.E = nn.Embedding(n_ent, dim)
        self.R = nn.Embedding(n_rel, dim)
        self.drop = nn.Dropout(dropout)
        nn.init.normal_(self.E.weight, std=dim ** -0.5)
        nn.init.normal_(self.R.weight, std=dim ** -0.5)

    def forward(self, triple, neg_tails):
        q = self.drop(self.E(triple[:, 0]) * self.R(triple[:, 1]))
        cand = torch.cat([triple[:, 2:3], neg_tails], dim=1)
        logits = torch.einsum("bd,bkd->bk", q, self.E(cand))
        target = torch.zeros(len(triple), dtype=torch.long, device=triple.device)
        return F.cross_entropy(logits, target)

    @torch.no_grad()
    def rank_all(self, h, r):
        return (self.E(h) * self.R(r)) @ self.E.weight.T


@torch.no_grad()
def evaluate(model, triples, known, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    chunk = torch.as_tensor(triples[rank::world], device=device)
    vals = torch.zeros(4, device=device, dtype=torch.float64)
    for i in range(0, len(chunk), 256):
        b = chunk[i:i + 256]
        s = model.rank_all(b[:, 0], b[:, 1])
        gold = s[torch.arange(len(b), device=device), b[:, 2]].clone()
        for j, (h, r, t) in enumerate(b.tolist()):
            s[j, known[(h, r)]] = -1e9
        s[torch.arange(len(b), device=device), b[:, 2]] = gold
        rk = 1 + (s > gold[:, None]).sum(1).double()
        vals[0] += (1 / rk).sum()
        vals[1] += (rk <= 1).sum()
        vals[2] += (rk <= 10).sum()
        vals[3] += len(rk)
    dist.all_reduce(vals)
    return dict(mrr=(vals[0] / vals[3]).item(), hits1=(vals[1] / vals[3]).item(),
                hits10=(vals[2] / vals[3]).item())


def save(path, model, opt, epoch, best, bad_epochs):
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": epoch,
                "best": best, "bad_epochs": bad_epochs}, path)


def main():
    a = args_()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device(f"cuda:{local_rank}")

    kg = KG(os.path.join(a.data_root, a.dataset))
    n_ent, n_rel = len(kg.ent), len(kg.rel)
    # reciprocal triples for head prediction
    def recip(x):
        return np.concatenate([x, np.stack([x[:, 2], x[:, 1] + n_rel, x[:, 0]], 1)])
    train, valid, test = (recip(kg.splits[s]) for s in ("train", "valid", "test"))
    known = defaultdict(list)
    for h, r, t in np.concatenate([train, valid, test]).tolist():
        known[(h, r)].append(t)

    ds = TypedNegatives(train, n_ent, a.negatives)
    sampler = DistributedSampler(ds, shuffle=True)
    loader = DataLoader(ds, batch_size=a.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, worker_init_fn=lambda w: np.random.seed(
                            (torch.initial_seed() + w) % 2 ** 32))

    model = DistMult(n_ent, 2 * n_rel, a.dim, a.dropout).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=a.lr, weight_decay=a.weight_decay)
    os.makedirs(a.exp_dir, exist_ok=True)
    last_path = os.path.join(a.exp_dir, "last.pt")
    best_path = os.path.join(a.exp_dir, "best.pt")
    start, best, bad = 0, 0.0, 0
    if a.resume and os.path.exists(last_path):
        ck = torch.load(last_path, map_location=dev)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start, best, bad = ck["epoch"] + 1, ck["best"], ck["bad_epochs"]
    ddp = DDP(model, device_ids=[local_rank])
    tb = SummaryWriter(os.path.join(a.exp_dir, "tb")) if rank == 0 else None

    for epoch in range(start, a.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        t0, tot, n = time.time(), torch.zeros((), device=dev), 0
        for triple, neg in loader:
            triple, neg = triple.to(dev, non_blocking=True), neg.to(dev, non_blocking=True)
            loss = ddp(triple, neg)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += loss.detach()
            n += 1
        dist.all_reduce(tot)
        train_loss = tot.item() / (n * world)

        ddp.eval()
        m = evaluate(model, valid, known, dev)
        if m["mrr"] > best:
            best, bad = m["mrr"], 0
        else:
            bad += 1
        if rank == 0:
            tb.add_scalar("loss/train", train_loss, epoch)
            for k, v in m.items():
                tb.add_scalar(f"valid/{k}", v, epoch)
            print(f"epoch {epoch} loss {train_loss:.4f} valid {m} ({time.time() - t0:.0f}s)",
                  flush=True)

        save(last_path, model, opt, epoch, best, bad)
        if bad == 0:
            shutil.copyfile(last_path, best_path)
        if bad >= a.patience:
            break
        dist.barrier()

    dist.barrier()
    model.load_state_dict(torch.load(best_path, map_location=dev)["model"])
    m = evaluate(model, test, known, dev)
    if rank == 0:
        print("test", m)
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
