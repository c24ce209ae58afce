"""TransE-L2 on YAGO3-10 with batch-shared negatives (DGL-KE style), multi-GPU.

Edges are hash-partitioned by head entity so that every rank owns a disjoint slice of
the training graph; gradients of the (replicated) embedding tables are averaged by DDP.

    torchrun --nproc_per_node=8 06_transe_yago_partitioned.py --data_path data/YAGO3-10
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
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

log = logging.getLogger(__name__)


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data_path", default="data/YAGO3-10")
    p.add_argument("--save_dir", default="ckpts/transe_yago")
    p.add_argument("--hidden_dim", type=int, default=400)
    p.add_argument("--gamma", type=float, default=19.9)
    p.add_argument("--neg_chunk", type=int, default=256, help="negatives shared by a batch")
    p.add_argument("--batch_size", type=int, default=1000)
    p.add_argument("--lr", type=float, default=0.25)
    p.add_argument("--regularization", type=float, default=1e-9)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--eval_batch", type=int, default=64)
    p.add_argument("--eval_every", type=int, default=5)
    return p.parse_args()


def read_tsv(path):
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n").split("\t") for line in f if line.strip()]


def load_dataset(root):
    with open(os.path.join(root, "entities.dict")) as f:
        e2id = {name: int(i) for i, name in (l.rstrip("\n").split("\t") for l in f)}
    with open(os.path.join(root, "relations.dict")) as f:
        r2id = {name: int(i) for i, name in (l.rstrip("\n").split("\t") for l in f)}
    out = {}
    for split in ("train", "valid", "test"):
        out[split] = np.array([[e2id[h], r2id[r], e2id[t]] for h, r, t in read_tsv(os.path.join(root, split + ".txt"))],
                              dtype=np.int64)
    return out, len(e2id), len(r2id)


class TransE(nn.Module):
    def __init__(self, n_ent, n_rel, dim, gamma):
        super().__init__()
        self.gamma = gamma
        r = (gamma + 2.0) / dim
        self.entity = nn.Embedding(n_ent, dim)
        self.relation = nn.Embedding(n_rel, dim)
        nn.init.uniform_(self.entity.weight, -r, r)
        nn.init.uniform_(self.relation.weight, -r, r)

    def forward(self, pos, neg_ids, corrupt_tail):
        h = self.entity(pos[:, 0])
        r = self.relation(pos[:, 1])
        t = self.entity(pos[:, 2])
        neg = self.entity(neg_ids)  # [K, d], shared across batch
        pos_score = self.gamma - torch.norm(h + r - t, p=2, dim=-1)
        if corrupt_tail:
            neg_score = self.gamma - torch.cdist(h + r, neg, p=2)
        else:
            neg_score = self.gamma - torch.cdist(t - r, neg, p=2)
        reg = h.pow(2).sum() + r.pow(2).sum() + t.pow(2).sum()
        return pos_score, neg_score, reg

    @torch.no_grad()
    def rank_candidates(self, query, gold):
        d = torch.cdist(query, self.entity.weight, p=2)
        return d, d.gather(1, gold[:, None])


@torch.no_grad()
def evaluate(model, triples, known_t, known_h, bs, rank, world, device):
    model.eval()
    rows = triples[rank::world]
    acc = torch.zeros(4, dtype=torch.float64, device=device)
    for i in range(0, len(rows), bs):
        b = torch.from_numpy(rows[i:i + bs]).to(device)
        h, r, t = b.unbind(1)
        for q, gold, keys, known in ((model.entity(h) + model.relation(r), t, zip(h.tolist(), r.tolist()), known_t),
                                     (model.entity(t) - model.relation(r), h, zip(r.tolist(), t.tolist()), known_h)):
            dist_all, dist_gold = model.rank_candidates(q, gold)
            for j, k in enumerate(keys):
                dist_all[j, known[k]] = float("inf")
            rk = 1.0 + (dist_all < dist_gold).sum(1).double()
            acc += torch.stack([(1 / rk).sum(), (rk <= 1).sum(), (rk <= 10).sum(),
                                torch.tensor(rk.numel(), dtype=torch.float64, device=device)])
    dist.all_reduce(acc)
    return {"mrr": (acc[0] / acc[3]).item(), "hits@1": (acc[1] / acc[3]).item(), "hits@10": (acc[2] / acc[3]).item()}


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s r{rank} %(message)s")

    data, n_ent, n_rel = load_dataset(args.data_path)
    known_t, known_h = {}, {}
    for h, r, t in np.concatenate([data["train"], data["valid"], data["test"]]).tolist():
        known_t.setdefault((h, r), []).append(t)
        known_h.setdefault((r, t), []).append(h)

    # hash-partition edges by head entity: each edge lives on exactly one rank
    train = data["train"]
    part = torch.from_numpy(train[train[:, 0] % world == rank])
    loader = DataLoader(TensorDataset(part), batch_size=args.batch_size, shuffle=True, drop_last=True,
                        num_workers=2, pin_memory=True)
    log.info("rank %d: %d of %d training edges, %d batches", rank, len(part), len(train), len(loader))

    torch.manual_seed(0)
    model = TransE(n_ent, n_rel, args.hidden_dim, args.gamma).to(device)
    ddp = DistributedDataParallel(model, device_ids=[local_rank])
    opt = torch.optim.Adagrad(ddp.parameters(), lr=args.lr)
    gen = torch.Generator(device="cpu").manual_seed(1000 + rank)

    os.makedirs(args.save_dir, exist_ok=True)
    best = -1.0
    for epoch in range(args.epochs):
        ddp.train()
        t0 = time.time()
        stats = torch.zeros(2, device=device)
        for step, (pos,) in enumerate(loader):
            pos = pos.to(device, non_blocking=True)
            neg_ids = torch.randint(0, n_ent, (args.neg_chunk,), generator=gen).to(device, non_blocking=True)
            pos_score, neg_score, reg = ddp(pos, neg_ids, corrupt_tail=(step % 2 == 0))
            loss = -(F.logsigmoid(pos_score).mean() + F.logsigmoid(-neg_score).mean()) / 2
            loss = loss + args.regularization * reg
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            stats += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(stats)
        log.info("epoch %d loss %.4f %.0fs", epoch, (stats[0] / stats[1]).item(), time.time() - t0)

        if (epoch + 1) % args.eval_every == 0:
            res = evaluate(model, data["valid"], known_t, known_h, args.eval_batch, rank, world, device)
            log.info("valid %s", res)
            if res["mrr"] > best:
                best = res["mrr"]
                if rank == 0:
                    torch.save({"epoch": epoch, "state_dict": model.state_dict(), "args": vars(args)},
                               os.path.join(args.save_dir, "best.pth"))
            dist.barrier()

    sd = torch.load(os.path.join(args.save_dir, "best.pth"), map_location=device)["state_dict"]
    model.load_state_dict(sd)
    res = evaluate(model, data["test"], known_t, known_h, args.eval_batch, rank, world, device)
    log.info("test %s", res)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
