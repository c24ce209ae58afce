"""Small multi-model KGE trainer (TransE / DistMult / ComplEx) for DDP.

    torchrun --nproc_per_node=4 19_kge_multi_model.py --model complex --data data/FB15k-237 \
        --epochs 200 --out runs/complex_fb
"""
import argparse
import logging
import os
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class KGEModel(nn.Module):
    def __init__(self, kind, n_ent, n_rel, dim, margin=9.0):
        super().__init__()
        self.kind = kind
        width = 2 * dim if kind == "complex" else dim
        self.ent = nn.Embedding(n_ent, width)
        self.rel = nn.Embedding(n_rel, width)
        nn.init.xavier_uniform_(self.ent.weight)
        nn.init.xavier_uniform_(self.rel.weight)
        self.margin = margin
        self.dim = dim

    def score(self, h, r, t):
        """h, r: [B, 1, w]; t: [B or 1, K, w] -> [B, K]"""
        if self.kind == "transe":
            return self.margin - (h + r - t).norm(p=1, dim=-1)
        if self.kind == "distmult":
            return (h * r * t).sum(-1)
        hr, hi = h[..., :self.dim], h[..., self.dim:]
        rr, ri = r[..., :self.dim], r[..., self.dim:]
        tr, ti = t[..., :self.dim], t[..., self.dim:]
        return ((hr * rr - hi * ri) * tr + (hr * ri + hi * rr) * ti).sum(-1)

    def forward(self, pos, neg_t):
        h = self.ent(pos[:, 0]).unsqueeze(1)
        r = self.rel(pos[:, 1]).unsqueeze(1)
        cand = torch.cat([pos[:, 2:3], neg_t], dim=1)
        return self.score(h, r, self.ent(cand))

    @torch.no_grad()
    def score_all(self, h_idx, r_idx, chunk=8192):
        h = self.ent(h_idx).unsqueeze(1)
        r = self.rel(r_idx).unsqueeze(1)
        parts = []
        for s in range(0, self.ent.num_embeddings, chunk):
            parts.append(self.score(h, r, self.ent.weight[s:s + chunk].unsqueeze(0)))
        return torch.cat(parts, dim=1)


class Triples(Dataset):
    def __init__(self, t):
        self.t = t

    def __len__(self):
        return self.t.size(0)

    def __getitem__(self, i):
        return self.t[i]


def load(data_dir):
    def names(fn):
        return [l.rstrip("\n").split("\t")[-1] for l in open(os.path.join(data_dir, fn))]

    e2i = {e: i for i, e in enumerate(names("entities.dict"))}
    r2i = {r: i for i, r in enumerate(names("relations.dict"))}
    out = {}
    for s in ("train", "valid", "test"):
        rows = [l.rstrip("\n").split("\t") for l in open(os.path.join(data_dir, f"{s}.txt"))]
        out[s] = torch.tensor([[e2i[h], r2i[r], e2i[t]] for h, r, t in rows], dtype=torch.long)
    return out, len(e2i), len(r2i)


@torch.no_grad()
def evaluate(model, triples, filt, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = triples[rank::world]
    acc = torch.zeros(4, device=device, dtype=torch.float64)
    for s in range(0, mine.size(0), 128):
        b = mine[s:s + 128].to(device)
        sc = model.score_all(b[:, 0], b[:, 1])
        g = sc.gather(1, b[:, 2:3]).clone()
        for i, (h, r, _) in enumerate(b.tolist()):
            sc[i, filt[(h, r)]] = float("-inf")
        sc.scatter_(1, b[:, 2:3], g)
        rk = (sc > g).sum(1).double() + 1
        acc[0] += (1.0 / rk).sum()
        acc[1] += (rk <= 1).sum()
        acc[2] += (rk <= 10).sum()
        acc[3] += rk.numel()
    dist.all_reduce(acc)
    return {"mrr": (acc[0] / acc[3]).item(), "hits@1": (acc[1] / acc[3]).item(),
            "hits@10": (acc[2] / acc[3]).item()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["transe", "distmult", "complex"], default="complex")
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--neg", type=int, default=256)
    ap.add_argument("--batch_size", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--label_smoothing", type=float, default=0.0)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--eval_every", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    log = logging.getLogger("kge")
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    log.addHandler(h)

    data, n_ent, n_rel = load(args.data)
    recip = lambda x: torch.cat([x, torch.stack([x[:, 2], x[:, 1] + n_rel, x[:, 0]], 1)])
    train, valid, test = recip(data["train"]), recip(data["valid"]), recip(data["test"])
    filt = defaultdict(list)
    for hh, rr, tt in torch.cat([train, valid, test]).tolist():
        filt[(hh, rr)].append(tt)

    ds = Triples(train)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=2,
                        pin_memory=True)

    torch.manual_seed(args.seed)
    model = KGEModel(args.model, n_ent, 2 * n_rel, args.dim).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(ddp.parameters(), lr=args.lr)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = -1.0
    for epoch in range(args.epochs):
        t0 = time.time()
        ddp.train()
        stats = torch.zeros(2, device=device)
        for pos in loader:
            pos = pos.to(device, non_blocking=True)
            neg = torch.randint(n_ent, (pos.size(0), args.neg), device=device)
            logits = ddp(pos, neg)
            target = torch.zeros(pos.size(0), dtype=torch.long, device=device)
            loss = F.cross_entropy(logits, target, label_smoothing=args.label_smoothing)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            stats += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(stats)
        log.info("[%s] epoch %d loss %.4f (%.1fs)", args.model, epoch,
                 (stats[0] / stats[1]).item(), time.time() - t0)

        if (epoch + 1) % args.eval_every == 0:
            model.eval()
            m = evaluate(model, valid, filt, device)
            model.train()
            log.info("  valid %s", m)
            if rank == 0 and m["mrr"] > best:
                best = m["mrr"]
                torch.save({"args": vars(args), "model": model.state_dict(), "epoch": epoch},
                           os.path.join(args.out, "best.pt"))
            dist.barrier()

    ck = torch.load(os.path.join(args.out, "best.pt"), map_location=device, weights_only=False)
    model.load_state_dict(ck["model"])
    m = evaluate(model, test, filt, device)
    log.info("test %s (best epoch %d)", m, ck["epoch"])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
