#!/usr/bin/env python
"""Heterogeneous GraphSAGE for user -buys-> item link prediction.

Graph: users (learned embedding), items (precomputed text features), edges
user-clicks-item and user-buys-item (+ reverse).  Supervision edges are split
by user bucket (user_id % world_size), so ranks get different amounts of
work; the DDP Join context takes care of the ranks that run out first.
An auxiliary item-category head is trained every --aux-every steps.

    torchrun --nproc_per_node=8 hetero_sage_buys.py --raw /mnt/lake/graph_export/2024-06-01
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch_geometric.transforms as T
from sklearn.metrics import roc_auc_score
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.data import HeteroData
from torch_geometric.loader import LinkNeighborLoader
from torch_geometric.nn import SAGEConv, to_hetero

BUYS = ("user", "buys", "item")
REV_BUYS = ("item", "rev_buys", "user")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--raw", required=True, help="folder with users/items/clicks/buys parquet")
    ap.add_argument("--cache", default="/mnt/cache/graphs/buys_hetero_split.pt")
    ap.add_argument("--out", default="/mnt/experiments/hetero_buys")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--aux-every", type=int, default=10)
    ap.add_argument("--aux-weight", type=float, default=0.1)
    ap.add_argument("--hits-k", type=int, default=100)
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


def build_graph(raw):
    users = pd.read_parquet(f"{raw}/users.parquet")          # user_idx
    items = pd.read_parquet(f"{raw}/items.parquet")          # item_idx, category_idx, text_emb
    clicks = pd.read_parquet(f"{raw}/clicks.parquet")        # user_idx, item_idx
    buys = pd.read_parquet(f"{raw}/buys.parquet")            # user_idx, item_idx

    data = HeteroData()
    data["user"].node_id = torch.arange(len(users))
    items = items.sort_values("item_idx")
    data["item"].x = torch.from_numpy(np.stack(items["text_emb"].to_numpy())).float()
    data["item"].y = torch.from_numpy(items["category_idx"].to_numpy()).long()
    data["user", "clicks", "item"].edge_index = torch.from_numpy(clicks[["user_idx", "item_idx"]].to_numpy().T).long()
    data[BUYS].edge_index = torch.from_numpy(buys[["user_idx", "item_idx"]].to_numpy().T).long()
    data = T.ToUndirected()(data)

    split = T.RandomLinkSplit(num_val=0.05, num_test=0.05, neg_sampling_ratio=3.0,
                              add_negative_train_samples=False,
                              edge_types=[BUYS], rev_edge_types=[REV_BUYS])
    return split(data)


def load_or_build(args, rank):
    # Only rank 0 builds; the file is renamed into place once complete.
    if rank == 0 and not os.path.exists(args.cache):
        os.makedirs(os.path.dirname(args.cache), exist_ok=True)
        train_data, val_data, test_data = build_graph(args.raw)
        tmp = f"{args.cache}.tmp.{os.getpid()}"
        torch.save((train_data, val_data, test_data), tmp)
        os.replace(tmp, args.cache)
    dist.barrier()
    return torch.load(args.cache)


class GNN(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.conv1 = SAGEConv((-1, -1), hidden)
        self.conv2 = SAGEConv((-1, -1), hidden)

    def forward(self, x, edge_index):
        x = self.conv1(x, edge_index).relu()
        return self.conv2(x, edge_index)


class BuysModel(nn.Module):
    def __init__(self, num_users, hidden, num_categories, metadata):
        super().__init__()
        self.user_emb = nn.Embedding(num_users, hidden)
        self.item_lin = nn.LazyLinear(hidden)
        self.gnn = to_hetero(GNN(hidden), metadata, aggr="sum")
        self.cat_head = nn.Linear(hidden, num_categories)

    def forward(self, batch, with_aux=False):
        x_dict = {"user": self.user_emb(batch["user"].node_id), "item": self.item_lin(batch["item"].x)}
        h = self.gnn(x_dict, batch.edge_index_dict)
        src, dst = batch[BUYS].edge_label_index
        logits = (h["user"][src] * h["item"][dst]).sum(-1)
        aux = self.cat_head(h["item"]) if with_aux else None
        return logits, aux


def make_loader(data, edge_label_index, edge_label, args, train):
    return LinkNeighborLoader(
        data, num_neighbors=[10, 5],
        edge_label_index=(BUYS, edge_label_index), edge_label=edge_label,
        neg_sampling_ratio=1.0 if train else None,
        batch_size=args.batch_size if train else 4 * args.batch_size,
        shuffle=train, num_workers=args.workers, persistent_workers=train,
    )


@torch.no_grad()
def evaluate(model, data, args, rank, world_size, device):
    net = model.module
    net.eval()
    eli = data[BUYS].edge_label_index[:, rank::world_size]
    lbl = data[BUYS].edge_label[rank::world_size]
    scores, labels = [], []
    for batch in make_loader(data, eli, lbl, args, train=False):
        batch = batch.to(device)
        logits, _ = net(batch)
        scores.append(logits.sigmoid().cpu())
        labels.append(batch[BUYS].edge_label.cpu())
    net.train()
    gathered = [None] * world_size
    dist.all_gather_object(gathered, (torch.cat(scores), torch.cat(labels)))
    if rank != 0:
        return None
    s = torch.cat([g[0] for g in gathered])
    y = torch.cat([g[1] for g in gathered])
    neg = s[y == 0]
    kth = neg.topk(min(args.hits_k, neg.numel())).values[-1]
    return {"auc": roc_auc_score(y.numpy(), s.numpy()), f"hits@{args.hits_k}": (s[y == 1] > kth).float().mean().item()}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_data, val_data, test_data = load_or_build(args, rank)

    eli = train_data[BUYS].edge_label_index
    mine = (eli[0] % world_size) == rank
    train_loader = make_loader(train_data, eli[:, mine], train_data[BUYS].edge_label[mine], args, train=True)

    torch.manual_seed(0)
    num_cat = int(train_data["item"].y.max()) + 1
    model = BuysModel(train_data["user"].num_nodes, args.hidden, num_cat, train_data.metadata()).to(device)
    with torch.no_grad():  # materialise the lazy layers before wrapping
        model(next(iter(train_loader)).to(device), with_aux=True)
    # the category head is only used every --aux-every steps
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    print(f"rank {rank}: {int(mine.sum())} supervision edges, {len(train_loader)} batches", flush=True)

    best_auc = 0.0
    for epoch in range(args.epochs):
        t0 = time.time()
        stats = torch.zeros(2, device=device)
        with Join([model]):
            for i, batch in enumerate(train_loader):
                batch = batch.to(device)
                with_aux = i % args.aux_every == 0
                logits, aux = model(batch, with_aux=with_aux)
                loss = F.binary_cross_entropy_with_logits(logits, batch[BUYS].edge_label.float())
                if with_aux:
                    loss = loss + args.aux_weight * F.cross_entropy(aux, batch["item"].y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                stats += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(stats)

        res = evaluate(model, val_data, args, rank, world_size, device)
        if rank == 0:
            print(f"epoch {epoch} loss {(stats[0] / stats[1]).item():.4f} val {res} "
                  f"{time.time() - t0:.0f}s", flush=True)
            if res["auc"] > best_auc:
                best_auc = res["auc"]
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))

    dist.barrier()
    model.module.load_state_dict(torch.load(os.path.join(args.out, "best.pt"), map_location=device))
    res = evaluate(model, test_data, args, rank, world_size, device)
    if rank == 0:
        print(f"test {res}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
