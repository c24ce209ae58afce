#!/usr/bin/env python
"""Partition-parallel LightGCN: each GPU propagates over its own METIS partition.

The partitioner (graphpart/metis_bipartite.py) writes, for P partitions:
    <root>/meta.json        {"num_parts": P, "num_users": U, "num_items": I, ...}
    <root>/part_{p}.pt      {"train": LongTensor[2, E_p], "test": LongTensor[2, T_p]}
                            global user / item ids, 1-hop halo edges included
Embeddings live in the global id space, so gradients from all partitions are averaged by DDP.
Partitions are balanced only roughly, so an epoch is a fixed number of steps sampled with
replacement from the local edges.

    torchrun --nproc_per_node=8 partitioned_lightgcn.py --root /mnt/graphs/orders_metis8
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.nn import LGConv


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", default="/mnt/experiments/partitioned_lightgcn")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--steps-per-epoch", type=int, default=500)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--l2", type=float, default=1e-4)
    p.add_argument("--k", type=int, default=20)
    return p.parse_args()


class LightGCN(nn.Module):
    def __init__(self, num_users, num_items, dim, layers):
        super().__init__()
        self.num_users = num_users
        self.user = nn.Embedding(num_users, dim)
        self.item = nn.Embedding(num_items, dim)
        nn.init.xavier_uniform_(self.user.weight)
        nn.init.xavier_uniform_(self.item.weight)
        self.convs = nn.ModuleList([LGConv() for _ in range(layers)])

    def propagate(self, edge_index):
        x = torch.cat([self.user.weight, self.item.weight])
        out = [x]
        for conv in self.convs:
            x = conv(x, edge_index)
            out.append(x)
        out = torch.stack(out).mean(0)
        return out[: self.num_users], out[self.num_users:]

    def forward(self, edge_index, u, i, j):
        ue, ie = self.propagate(edge_index)
        pos = (ue[u] * ie[i]).sum(-1)
        neg = (ue[u] * ie[j]).sum(-1)
        reg = (self.user(u).pow(2).sum() + self.item(i).pow(2).sum() + self.item(j).pow(2).sum()) / u.numel()
        return pos, neg, reg


@torch.no_grad()
def recall_at_k(model, edge_index, train_ei, test_ei, k, device):
    net = model.module
    ue, ie = net.propagate(edge_index)
    users = torch.unique(test_ei[0])
    hits = torch.zeros(2, device=device)
    for chunk in users.split(2048):
        slot = torch.full((net.num_users,), -1, dtype=torch.long, device=device)
        slot[chunk] = torch.arange(chunk.numel(), device=device)
        s = ue[chunk] @ ie.t()
        r = slot[train_ei[0]]
        s[r[r >= 0], train_ei[1][r >= 0]] = -1e9
        t = torch.zeros_like(s, dtype=torch.bool)
        r = slot[test_ei[0]]
        t[r[r >= 0], test_ei[1][r >= 0]] = True
        rel = t.gather(1, s.topk(k, 1).indices).sum(1).float()
        hits[0] += (rel / t.sum(1).clamp(max=k)).sum()
        hits[1] += chunk.numel()
    dist.all_reduce(hits)
    return (hits[0] / hits[1]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    with open(os.path.join(args.root, "meta.json")) as f:
        meta = json.load(f)
    assert meta["num_parts"] == world, f"graph has {meta['num_parts']} partitions, launched {world} ranks"

    part = torch.load(os.path.join(args.root, f"part_{rank}.pt"))
    train_ei = part["train"].to(device)
    test_ei = part["test"].to(device)
    num_users = int(train_ei[0].max()) + 1
    num_items = int(train_ei[1].max()) + 1
    ui = torch.stack([train_ei[0], train_ei[1] + num_users])
    edge_index = torch.cat([ui, ui.flip(0)], dim=1)
    print(f"rank {rank}: partition edges {train_ei.size(1)} test {test_ei.size(1)}", flush=True)

    torch.manual_seed(0)
    model = LightGCN(num_users, num_items, args.dim, args.layers).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    gen = torch.Generator(device=device).manual_seed(1000 + rank)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for _ in range(args.steps_per_epoch):
            idx = torch.randint(0, train_ei.size(1), (args.batch_size,), device=device, generator=gen)
            u, i = train_ei[0, idx], train_ei[1, idx]
            j = torch.randint(0, num_items, (args.batch_size,), device=device, generator=gen)
            pos, neg, reg = model(edge_index, u, i, j)
            loss = F.softplus(neg - pos).mean() + args.l2 * reg
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)

        recall = recall_at_k(model, edge_index, train_ei, test_ei, args.k, device)
        if rank == 0:
            print(f"epoch {epoch} loss {(tot[0] / tot[1]).item():.4f} recall@{args.k} {recall:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if recall > best:
                best = recall
                torch.save({"model": model.module.state_dict(), "meta": meta, "epoch": epoch},
                           os.path.join(args.out, "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
