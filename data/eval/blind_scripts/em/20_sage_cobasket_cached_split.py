#!/usr/bin/env python
"""Co-basket item graph: GraphSAGE link prediction.

The raw export is a CSV of (item_a, item_b, n_baskets) plus an item feature parquet.
Building the PyG graph and the link split takes ~20 min, so the result is cached next
to the raw data and reused by later runs.

    torchrun --nproc_per_node=8 sage_cobasket.py --raw /mnt/lake/cobasket/2024-06-02 --min-baskets 3
"""
import argparse
import os
import random
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.data import Data
from torch_geometric.loader import LinkNeighborLoader
from torch_geometric.nn import SAGEConv
from torch_geometric.transforms import RandomLinkSplit
from torch_geometric.utils import coalesce, to_undirected


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--raw", required=True)
    p.add_argument("--min-baskets", type=int, default=3)
    p.add_argument("--out", default="/mnt/experiments/cobasket_sage")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=2048, help="per GPU, lr tuned for 8 GPUs")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--hits-k", type=int, default=50)
    return p.parse_args()


def build_dataset(raw, min_baskets):
    feats = pd.read_parquet(os.path.join(raw, "item_features.parquet")).sort_values("item_idx")
    x = torch.from_numpy(np.stack(feats["embedding"].to_numpy())).float()
    edges = pd.read_csv(os.path.join(raw, "cobasket_pairs.csv"), dtype={"item_a": np.int64, "item_b": np.int64})
    edges = edges[edges["n_baskets"] >= min_baskets]
    ei = torch.from_numpy(edges[["item_a", "item_b"]].to_numpy().T.copy())
    w = torch.from_numpy(np.log1p(edges["n_baskets"].to_numpy())).float()
    ei, w = to_undirected(ei, w, num_nodes=x.size(0), reduce="max")
    ei, w = coalesce(ei, w, num_nodes=x.size(0))
    data = Data(x=x, edge_index=ei, edge_weight=w)
    random.seed(20240602)
    torch.manual_seed(20240602)
    split = RandomLinkSplit(num_val=0.05, num_test=0.05, is_undirected=True,
                            add_negative_train_samples=False, neg_sampling_ratio=3.0)
    return split(data)


def get_dataset(args):
    cache = os.path.join(args.raw, f"pyg_split_min{args.min_baskets}.pt")
    if os.path.exists(cache):
        return torch.load(cache)
    train, val, test = build_dataset(args.raw, args.min_baskets)
    torch.save((train, val, test), cache)
    return train, val, test


class Net(nn.Module):
    def __init__(self, in_dim, hidden):
        super().__init__()
        self.conv1 = SAGEConv(in_dim, hidden)
        self.conv2 = SAGEConv(hidden, hidden)
        self.head = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x, edge_index, edge_label_index):
        h = self.conv1(x, edge_index).relu()
        h = F.dropout(h, 0.2, self.training)
        h = self.conv2(h, edge_index)
        return self.head(h[edge_label_index[0]] * h[edge_label_index[1]]).view(-1)


def make_loader(d, eli, lbl, args, train):
    return LinkNeighborLoader(d, num_neighbors=[15, 10], edge_label_index=eli, edge_label=lbl,
                              neg_sampling_ratio=1.0 if train else None,
                              batch_size=args.batch_size if train else 8192, shuffle=train,
                              drop_last=train, num_workers=args.workers, persistent_workers=train)


@torch.no_grad()
def hits_eval(model, d, args, rank, world, device):
    model.eval()
    eli, lbl = d.edge_label_index[:, rank::world], d.edge_label[rank::world]
    pos, neg = [], []
    for b in make_loader(d, eli, lbl, args, train=False):
        b = b.to(device)
        s = model.module(b.x, b.edge_index, b.edge_label_index)
        pos.append(s[b.edge_label == 1])
        neg.append(s[b.edge_label == 0])
    pos, neg = torch.cat(pos), torch.cat(neg)
    top = neg.topk(args.hits_k).values
    tops = [torch.empty_like(top) for _ in range(world)]
    dist.all_gather(tops, top)
    kth = torch.cat(tops).topk(args.hits_k).values[-1]
    c = torch.stack([(pos > kth).float().sum(), torch.tensor(float(pos.numel()), device=device)])
    dist.all_reduce(c)
    model.train()
    return (c[0] / c[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    t_load = time.time()
    train_data, val_data, test_data = get_dataset(args)
    if rank == 0:
        print(f"dataset ready in {time.time() - t_load:.0f}s: {train_data.num_nodes} items, "
              f"{train_data.edge_index.size(1)} message edges", flush=True)

    n = train_data.edge_label_index.size(1) // world
    perm = torch.randperm(train_data.edge_label_index.size(1), generator=torch.Generator().manual_seed(1))
    mine = perm[rank * n:(rank + 1) * n]
    loader = make_loader(train_data, train_data.edge_label_index[:, mine], train_data.edge_label[mine],
                         args, train=True)

    torch.manual_seed(0)
    model = DDP(Net(train_data.num_features, args.hidden).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for b in loader:
            b = b.to(device, non_blocking=True)
            out = model(b.x, b.edge_index, b.edge_label_index)
            loss = F.binary_cross_entropy_with_logits(out, b.edge_label)
            opt.zero_grad()
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(tot)
        hits = hits_eval(model, val_data, args, rank, world, device)
        if rank == 0:
            print(f"epoch {epoch} loss {(tot[0] / tot[1]).item():.4f} val hits@{args.hits_k} {hits:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if hits > best:
                best = hits
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))

    dist.barrier()
    model.module.load_state_dict(torch.load(os.path.join(args.out, "best.pt"), map_location=device))
    hits = hits_eval(model, test_data, args, rank, world, device)
    if rank == 0:
        print(f"test hits@{args.hits_k} {hits:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
