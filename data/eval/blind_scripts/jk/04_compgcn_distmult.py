"""CompGCN encoder + DistMult decoder, 1-to-N training, DDP over GPUs.

The full graph is small (FB15k-237), so every rank keeps it on its GPU and runs the
GCN over all nodes; only the (subject, relation) query batches are split.

    torchrun --nproc_per_node=4 04_compgcn_distmult.py --data data/FB15k-237 --opn mult
"""
import argparse
import logging
import os
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("compgcn")


def ccorr(a, b):
    return torch.fft.irfft(torch.conj(torch.fft.rfft(a, dim=-1)) * torch.fft.rfft(b, dim=-1), n=a.shape[-1], dim=-1)


def compose(ent, rel, opn):
    if opn == "sub":
        return ent - rel
    if opn == "mult":
        return ent * rel
    return ccorr(ent, rel)


class CompGCNConv(nn.Module):
    def __init__(self, in_dim, out_dim, opn, dropout):
        super().__init__()
        self.opn = opn
        self.w_in = nn.Linear(in_dim, out_dim, bias=False)
        self.w_out = nn.Linear(in_dim, out_dim, bias=False)
        self.w_loop = nn.Linear(in_dim, out_dim, bias=False)
        self.w_rel = nn.Linear(in_dim, out_dim, bias=False)
        self.loop_rel = nn.Parameter(torch.empty(1, in_dim))
        nn.init.xavier_normal_(self.loop_rel)
        self.bias = nn.Parameter(torch.zeros(out_dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x, rel, edge_index, edge_type, norm, num_fwd):
        src, dst = edge_index
        msg = compose(x[src], rel[edge_type], self.opn)
        msg_in = self.w_in(msg[:num_fwd]) * norm[:num_fwd, None]
        msg_out = self.w_out(msg[num_fwd:]) * norm[num_fwd:, None]
        agg = torch.zeros(x.size(0), msg_in.size(1), device=x.device, dtype=msg_in.dtype)
        agg.index_add_(0, dst[:num_fwd], msg_in)
        agg.index_add_(0, dst[num_fwd:], msg_out)
        loop = self.w_loop(compose(x, self.loop_rel, self.opn))
        out = self.drop(agg) * (1 / 3) + self.drop(loop) * (1 / 3) + self.bias
        return torch.tanh(out), self.w_rel(rel)


class CompGCN(nn.Module):
    def __init__(self, num_ent, num_rel, graph, dim=200, opn="mult", layers=1, gcn_drop=0.1, hid_drop=0.3):
        super().__init__()
        self.ent_emb = nn.Parameter(torch.empty(num_ent, dim))
        self.rel_emb = nn.Parameter(torch.empty(2 * num_rel, dim))
        nn.init.xavier_normal_(self.ent_emb)
        nn.init.xavier_normal_(self.rel_emb)
        self.convs = nn.ModuleList([CompGCNConv(dim, dim, opn, gcn_drop) for _ in range(layers)])
        self.ent_bias = nn.Parameter(torch.zeros(num_ent))
        self.hid_drop = nn.Dropout(hid_drop)
        # fixed training graph; kept out of state_dict / buffers
        self.edge_index = graph["edge_index"]
        self.edge_type = graph["edge_type"]
        self.edge_norm = graph["edge_norm"]
        self.num_fwd = graph["num_fwd"]

    def encode(self):
        x, r = self.ent_emb, self.rel_emb
        for conv in self.convs:
            x, r = conv(x, r, self.edge_index, self.edge_type, self.edge_norm, self.num_fwd)
            x = self.hid_drop(x)
        return x, r

    def decode(self, x, r, sub, rel):
        q = x[sub] * r[rel]
        return q @ x.t() + self.ent_bias

    def forward(self, sub, rel):
        x, r = self.encode()
        return self.decode(x, r, sub, rel)


def load(path):
    with open(path) as f:
        return [l.strip().split("\t") for l in f if l.strip()]


def build_graph(train, num_ent, num_rel):
    h, r, t = train.t()
    src = torch.cat([h, t])
    dst = torch.cat([t, h])
    etype = torch.cat([r, r + num_rel])
    deg = torch.zeros(num_ent).index_add_(0, dst, torch.ones_like(dst, dtype=torch.float))
    norm = deg[src].clamp(min=1).rsqrt() * deg[dst].clamp(min=1).rsqrt()
    return {"edge_index": torch.stack([src, dst]), "edge_type": etype, "edge_norm": norm,
            "num_fwd": h.numel()}


class QueryDataset(Dataset):
    def __init__(self, sr2o, num_ent, smoothing):
        self.items = sorted(sr2o.items())
        self.num_ent = num_ent
        self.smoothing = smoothing

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        (s, r), objs = self.items[i]
        y = torch.zeros(self.num_ent)
        y[list(objs)] = 1.0
        y = (1.0 - self.smoothing) * y + 1.0 / self.num_ent
        return torch.tensor([s, r]), y


@torch.no_grad()
def evaluate(model, triples, sr2o_all, num_rel, device, rank, world, bs=256):
    model.eval()
    ent, rel = model.encode()
    part = triples[rank::world]
    stats = torch.zeros(5, device=device, dtype=torch.float64)
    for i in range(0, part.size(0), bs):
        b = part[i:i + bs].to(device)
        for sub, r, obj in ((b[:, 0], b[:, 1], b[:, 2]), (b[:, 2], b[:, 1] + num_rel, b[:, 0])):
            pred = torch.sigmoid(model.decode(ent, rel, sub, r))
            target = pred[torch.arange(sub.size(0), device=device), obj].clone()
            for j, (s_, r_) in enumerate(zip(sub.tolist(), r.tolist())):
                pred[j, list(sr2o_all[(s_, r_)])] = 0.0
            rank_ = 1 + (pred > target.unsqueeze(1)).sum(1).double()
            stats += torch.stack([(1 / rank_).sum(), (rank_ <= 1).sum(), (rank_ <= 3).sum(),
                                  (rank_ <= 10).sum(), torch.tensor(float(rank_.numel()), device=device)])
    dist.all_reduce(stats)
    return dict(zip(["mrr", "hits@1", "hits@3", "hits@10"], (stats[:4] / stats[4]).tolist()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/FB15k-237")
    ap.add_argument("--opn", default="corr", choices=["sub", "mult", "corr"])
    ap.add_argument("--dim", type=int, default=200)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--l2", type=float, default=0.0)
    ap.add_argument("--smoothing", type=float, default=0.1)
    ap.add_argument("--epochs", type=int, default=500)
    ap.add_argument("--eval_every", type=int, default=10)
    ap.add_argument("--ckpt", default="checkpoints/compgcn.pt")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, format="%(asctime)s %(message)s")

    raw = {s: load(os.path.join(args.data, f"{s}.txt")) for s in ("train", "valid", "test")}
    ents = sorted({x for rows in raw.values() for h, _, t in rows for x in (h, t)})
    rels = sorted({r for rows in raw.values() for _, r, _ in rows})
    e2id, r2id = {e: i for i, e in enumerate(ents)}, {r: i for i, r in enumerate(rels)}
    trip = {s: torch.tensor([[e2id[h], r2id[r], e2id[t]] for h, r, t in rows]) for s, rows in raw.items()}
    ne, nr = len(ents), len(rels)

    sr2o_train, sr2o_all = defaultdict(set), defaultdict(set)
    for split, tr in trip.items():
        for h, r, t in tr.tolist():
            sr2o_all[(h, r)].add(t)
            sr2o_all[(t, r + nr)].add(h)
            if split == "train":
                sr2o_train[(h, r)].add(t)
                sr2o_train[(t, r + nr)].add(h)

    graph = {k: v.to(device) if torch.is_tensor(v) else v for k, v in build_graph(trip["train"], ne, nr).items()}
    torch.manual_seed(41504)
    model = CompGCN(ne, nr, graph, args.dim, args.opn, args.layers).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.l2)

    ds = QueryDataset(sr2o_train, ne, args.smoothing)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch, sampler=sampler, num_workers=4, pin_memory=True)
    logger.info("entities %d relations %d queries %d (%d per rank)", ne, nr, len(ds), len(sampler))

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        acc = torch.zeros(2, device=device)
        for q, y in loader:
            q, y = q.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(q[:, 0], q[:, 1])
            loss = F.binary_cross_entropy_with_logits(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(acc)
        logger.info("epoch %d loss %.5f", epoch, (acc[0] / acc[1]).item())

        if (epoch + 1) % args.eval_every == 0:
            val = evaluate(model, trip["valid"], sr2o_all, nr, device, rank, world)
            logger.info("epoch %d valid %s", epoch, {k: round(v, 4) for k, v in val.items()})
            if val["mrr"] > best:
                best = val["mrr"]
                if rank == 0:
                    os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
                    torch.save({"epoch": epoch, "model": model.module.state_dict(), "opt": opt.state_dict(),
                                "valid": val, "args": vars(args)}, args.ckpt)
            dist.barrier()

    state = torch.load(args.ckpt, map_location=device)
    model.module.load_state_dict(state["model"])
    test = evaluate(model, trip["test"], sr2o_all, nr, device, rank, world)
    logger.info("test @ epoch %d: %s", state["epoch"], {k: round(v, 4) for k, v in test.items()})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
