"""RESCAL, 1vsAll training with reciprocal relations (LibKGE-style recipe), DDP.

After training, the best checkpoint is evaluated on test and its entity / relation
embeddings are exported as .npy for the downstream recommender.

    torchrun --nproc_per_node=4 20_rescal_1vsall_export.py --data data/FB15k-237 --out runs/rescal_fb237
    python 20_rescal_1vsall_export.py --data data/FB15k-237 --out runs/rescal_fb237 --export_only
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
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/FB15k-237")
    ap.add_argument("--out", default="runs/rescal_fb237")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.3)
    ap.add_argument("--ent_dropout", type=float, default=0.37)
    ap.add_argument("--weight_decay", type=float, default=1e-9)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--eval_every", type=int, default=5)
    ap.add_argument("--export_only", action="store_true")
    return ap.parse_args()


def read_data(root):
    def read_map(name):
        with open(os.path.join(root, name)) as f:
            return {k: int(v) for v, k in (l.rstrip("\n").split("\t") for l in f)}

    e2i, r2i = read_map("entities.dict"), read_map("relations.dict")
    nr = len(r2i)
    out = {}
    for s in ("train", "valid", "test"):
        with open(os.path.join(root, f"{s}.txt")) as f:
            x = torch.tensor([[e2i[h], r2i[r], e2i[t]] for h, r, t in (l.rstrip("\n").split("\t") for l in f)])
        out[s] = torch.cat([x, torch.stack([x[:, 2], x[:, 1] + nr, x[:, 0]], 1)])
    return out, e2i, r2i


class RESCAL(nn.Module):
    def __init__(self, n_ent, n_rel, dim, ent_dropout=0.0):
        super().__init__()
        self.dim = dim
        self.ent = nn.Embedding(n_ent, dim)
        self.rel = nn.Embedding(n_rel, dim * dim)
        self.drop = nn.Dropout(ent_dropout)
        nn.init.xavier_normal_(self.ent.weight)
        nn.init.xavier_normal_(self.rel.weight.view(n_rel, dim, dim))

    def forward(self, s, r):
        es = self.drop(self.ent(s))
        mr = self.rel(r).view(-1, self.dim, self.dim)
        q = torch.bmm(es.unsqueeze(1), mr).squeeze(1)
        return q @ self.drop(self.ent.weight).t()


@torch.no_grad()
def filtered_metrics(model, queries, known, device, rank, world, bs=512):
    model.eval()
    mine = queries[rank::world]
    acc = torch.zeros(5, dtype=torch.float64, device=device)
    for i in range(0, len(mine), bs):
        q = mine[i:i + bs].to(device)
        sc = model(q[:, 0], q[:, 1])
        gold = sc.gather(1, q[:, 2:3])
        for j, (s, r) in enumerate(q[:, :2].tolist()):
            sc[j, known[(s, r)]] = float("-inf")
        rk = 1 + (sc > gold).sum(1).double()
        acc += torch.stack([(1 / rk).sum(), (rk <= 1).sum(), (rk <= 3).sum(), (rk <= 10).sum(),
                            torch.tensor(float(len(rk)), dtype=torch.float64, device=device)])
    if world > 1:
        dist.all_reduce(acc)
    return dict(zip(("mrr", "hits@1", "hits@3", "hits@10"), (acc[:4] / acc[4]).tolist()))


def export_embeddings(args, n_ent, n_rel, e2i, r2i):
    ckpt = torch.load(os.path.join(args.out, "best.pt"), map_location="cpu")
    model = RESCAL(n_ent, n_rel, args.dim)
    model.load_state_dict(ckpt["model"])
    np.save(os.path.join(args.out, "entity_embeddings.npy"), model.ent.weight.numpy())
    np.save(os.path.join(args.out, "relation_matrices.npy"),
            model.rel.weight.view(n_rel, args.dim, args.dim).numpy())
    with open(os.path.join(args.out, "ids.json"), "w") as f:
        json.dump({"entities": e2i, "relations": r2i}, f)
    print(f"exported embeddings of epoch {ckpt['epoch']} to {args.out}", flush=True)


def main():
    args = get_args()
    data, e2i, r2i = read_data(args.data)
    n_ent, n_rel = len(e2i), 2 * len(r2i)
    if args.export_only:
        export_embeddings(args, n_ent, n_rel, e2i, r2i)
        return

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    known = {}
    for s in ("train", "valid", "test"):
        for a, r, b in data[s].tolist():
            known.setdefault((a, r), []).append(b)

    torch.manual_seed(11)
    model = RESCAL(n_ent, n_rel, args.dim, args.ent_dropout).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adagrad(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=4)

    ds = TensorDataset(data["train"])
    sampler = DistributedSampler(ds, shuffle=True)
    loader = DataLoader(ds, batch_size=args.batch, sampler=sampler, num_workers=2, pin_memory=True)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = -1.0
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        model.train()
        t0, agg = time.time(), torch.zeros(2, device=device)
        for (x,) in loader:
            x = x.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x[:, 0], x[:, 1]), x[:, 2])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            agg += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(agg)
        if rank == 0:
            print(f"epoch {epoch} loss {(agg[0] / agg[1]).item():.4f} lr {opt.param_groups[0]['lr']:.3g} "
                  f"{time.time() - t0:.0f}s", flush=True)

        if epoch % args.eval_every == 0:
            m = filtered_metrics(model.module, data["valid"], known, device, rank, world)
            sched.step(m["mrr"])
            if rank == 0:
                print(f"  valid {m}", flush=True)
                if m["mrr"] > best:
                    best = m["mrr"]
                    torch.save({"epoch": epoch, "model": model.state_dict(), "valid": m},
                               os.path.join(args.out, "best.pt"))
            dist.barrier()

    ckpt = torch.load(os.path.join(args.out, "best.pt"), map_location=device)
    model.module.load_state_dict(ckpt["model"])
    m = filtered_metrics(model.module, data["test"], known, device, rank, world)
    if rank == 0:
        print(f"test (epoch {ckpt['epoch']}): {m}", flush=True)
        with open(os.path.join(args.out, "test_metrics.json"), "w") as f:
            json.dump(m, f, indent=2)
        export_embeddings(args, n_ent, n_rel, e2i, r2i)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
