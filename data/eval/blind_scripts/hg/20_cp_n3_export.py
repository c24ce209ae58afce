"""CP decomposition with N3 regularisation and reciprocal relations
(Lacroix, Usunier & Obozinski, ICML 2018), multi-GPU.

At the end the best checkpoint is reloaded into a fresh model for the test
split, and the entity / relation factors are exported for downstream use.

    torchrun --nproc_per_node=4 20_cp_n3_export.py --dataset data/YAGO3-10 --rank 1000 --reg 5e-3
"""
import argparse
import json
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("cp_n3")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", required=True)
    p.add_argument("--out", default="runs/cp_n3")
    p.add_argument("--rank", type=int, default=1000, help="CP rank")
    p.add_argument("--init", type=float, default=1e-3)
    p.add_argument("--reg", type=float, default=5e-3)
    p.add_argument("--batch_size", type=int, default=500)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--valid", type=int, default=5, help="validate every N epochs")
    return p.parse_args()


def load_dataset(root):
    ent, rel = {}, {}
    raw = {}
    for split in ("train", "valid", "test"):
        with open(os.path.join(root, f"{split}.txt")) as f:
            raw[split] = [line.strip().split("\t") for line in f if line.strip()]
    for split in ("train", "valid", "test"):
        for h, r, t in raw[split]:
            ent.setdefault(h, len(ent))
            rel.setdefault(r, len(rel))
            ent.setdefault(t, len(ent))
    n_rel = len(rel)
    data = {}
    for split, rows in raw.items():
        x = np.array([(ent[h], rel[r], ent[t]) for h, r, t in rows], dtype=np.int64)
        x_inv = np.stack([x[:, 2], x[:, 1] + n_rel, x[:, 0]], axis=1)
        data[split] = torch.from_numpy(np.concatenate([x, x_inv]))
    return data, ent, rel


class CP(nn.Module):
    def __init__(self, n_ent, n_rel, rank, init_size):
        super().__init__()
        self.lhs = nn.Embedding(n_ent, rank)
        self.rel = nn.Embedding(n_rel, rank)
        self.rhs = nn.Embedding(n_ent, rank)
        for e in (self.lhs, self.rel, self.rhs):
            e.weight.data *= init_size

    def forward(self, x):
        lhs, rel, rhs = self.lhs(x[:, 0]), self.rel(x[:, 1]), self.rhs(x[:, 2])
        return (lhs * rel) @ self.rhs.weight.t(), (lhs, rel, rhs)


def n3(factors):
    return sum(torch.sum(torch.abs(f) ** 3) for f in factors) / factors[0].shape[0]


@torch.no_grad()
def ranking_metrics(model, queries, to_skip, device, rank, world, chunk=1000):
    model.eval()
    mine = queries[rank::world]
    acc = torch.zeros(5, device=device, dtype=torch.float64)
    for i in range(0, len(mine), chunk):
        x = mine[i:i + chunk].to(device)
        scores, _ = model(x)
        target = scores.gather(1, x[:, 2:3])
        for j, (h, r, _) in enumerate(x.tolist()):
            scores[j, to_skip[(h, r)]] = -1e6
        rk = (scores >= target).sum(1).double() + 1
        acc += torch.stack([(1 / rk).sum(), (rk <= 1).sum().double(), (rk <= 3).sum().double(),
                            (rk <= 10).sum().double(), rk.new_tensor(len(rk))])
    dist.all_reduce(acc)
    model.train()
    n = acc[4]
    return {"MRR": (acc[0] / n).item(), "hits@1": (acc[1] / n).item(),
            "hits@3": (acc[2] / n).item(), "hits@10": (acc[3] / n).item()}


def main():
    args = parse_args()
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s | %(message)s")

    data, ent, rel = load_dataset(args.dataset)
    to_skip = {}
    for h, r, t in torch.cat(list(data.values())).tolist():
        to_skip.setdefault((h, r), []).append(t)

    ds = TensorDataset(data["train"])
    sampler = DistributedSampler(ds, shuffle=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, drop_last=True, num_workers=2)

    model = CP(len(ent), 2 * len(rel), args.rank, args.init).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adagrad(model.parameters(), lr=args.lr)
    best_path = os.path.join(args.out, "best.pt")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0, run, n = time.time(), 0.0, 0
        for (x,) in loader:
            x = x.to(device, non_blocking=True)
            scores, factors = model(x)
            loss = F.cross_entropy(scores, x[:, 2]) + args.reg * n3(factors)
            opt.zero_grad()
            loss.backward()
            opt.step()
            run, n = run + loss.item(), n + 1
        logger.info("epoch %d  loss %.4f  %.1fs", epoch, run / n, time.time() - t0)

        if (epoch + 1) % args.valid == 0:
            m = ranking_metrics(model.module, data["valid"], to_skip, device, rank, world)
            logger.info("epoch %d  valid %s", epoch, json.dumps(m))
            if m["MRR"] > best:
                best = m["MRR"]
                if rank == 0:
                    torch.save(model.state_dict(), best_path)
            dist.barrier()

    del model, opt
    torch.cuda.empty_cache()
    best_model = CP(len(ent), 2 * len(rel), args.rank, args.init).to(device)
    best_model.load_state_dict(torch.load(best_path, map_location=device))
    m = ranking_metrics(best_model, data["test"], to_skip, device, rank, world)
    logger.info("test %s", json.dumps(m))

    if rank == 0:
        id2ent = {i: e for e, i in ent.items()}
        id2rel = {i: r for r, i in rel.items()}
        np.save(os.path.join(args.out, "entity_lhs.npy"), best_model.lhs.weight.detach().cpu().numpy())
        np.save(os.path.join(args.out, "entity_rhs.npy"), best_model.rhs.weight.detach().cpu().numpy())
        np.save(os.path.join(args.out, "relation.npy"), best_model.rel.weight.detach().cpu().numpy())
        with open(os.path.join(args.out, "vocab.json"), "w") as f:
            json.dump({"entities": [id2ent[i] for i in range(len(id2ent))],
                       "relations": [id2rel[i] for i in range(len(id2rel))]}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
