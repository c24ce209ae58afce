#!/usr/bin/env python
"""LightGCN on the user x item purchase graph, data parallel over all local GPUs.

Input is the output of build_purchase_graph.py:
    {"num_users": int, "num_items": int,
     "train": LongTensor[2, E],   # row 0 = user id, row 1 = item id (both 0-based)
     "val":   LongTensor[2, E_val],
     "test":  LongTensor[2, E_test]}

    torchrun --nproc_per_node=8 train_lightgcn_purchase.py --data /mnt/graphs/purchase/v7/graph.pt
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.nn import LightGCN
from torch_geometric.utils import to_undirected


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/mnt/graphs/purchase/v7/graph.pt")
    p.add_argument("--out", default="/mnt/experiments/lightgcn_purchase")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=16384, help="global batch of positive edges")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--reg", type=float, default=1e-4)
    p.add_argument("--k", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--eval-users", type=int, default=4096, help="users per scoring chunk")
    p.add_argument("--seed", type=int, default=7)
    return p.parse_args()


class BPRLightGCN(torch.nn.Module):
    """LightGCN + BPR. Users are nodes [0, U), items are nodes [U, U + I)."""

    def __init__(self, num_users, num_items, dim, layers):
        super().__init__()
        self.num_users = num_users
        self.num_items = num_items
        self.gcn = LightGCN(num_users + num_items, dim, layers)

    def forward(self, edge_index, users, pos_items, neg_items):
        emb = self.gcn.get_embedding(edge_index)
        u = emb[users]
        p = emb[pos_items + self.num_users]
        n = emb[neg_items + self.num_users]
        pos_score = (u * p).sum(-1)
        neg_score = (u * n).sum(-1)
        ego = self.gcn.embedding.weight
        reg = (ego[users].pow(2).sum() + ego[pos_items + self.num_users].pow(2).sum()
               + ego[neg_items + self.num_users].pow(2).sum()) / users.numel()
        return pos_score, neg_score, reg


def build_mask(users, edges, num_users, num_items):
    """Dense [len(users), num_items] bool mask of the user->item edges of these users."""
    row_of = torch.full((num_users,), -1, dtype=torch.long, device=users.device)
    row_of[users] = torch.arange(users.numel(), device=users.device)
    rows = row_of[edges[0]]
    sel = rows >= 0
    mask = torch.zeros(users.numel(), num_items, dtype=torch.bool, device=users.device)
    mask[rows[sel], edges[1, sel]] = True
    return mask


@torch.no_grad()
def evaluate(model, msg_edge_index, train_edges, eval_edges, k, chunk, rank, world_size, device):
    model.eval()
    inner = model.module
    emb = inner.gcn.get_embedding(msg_edge_index)
    user_emb, item_emb = emb[:inner.num_users], emb[inner.num_users:]

    users = torch.unique(eval_edges[0])
    users = users[rank::world_size]

    discount = 1.0 / torch.log2(torch.arange(2, k + 2, device=device, dtype=torch.float))
    idcg_table = discount.cumsum(0)

    recall_sum, ndcg_sum, n_users = 0.0, 0.0, 0
    for batch_users in users.split(chunk):
        scores = user_emb[batch_users] @ item_emb.t()
        seen = build_mask(batch_users, train_edges, inner.num_users, inner.num_items)
        scores[seen] = float("-inf")
        truth = build_mask(batch_users, eval_edges, inner.num_users, inner.num_items)

        topk = scores.topk(k, dim=-1).indices
        hits = truth.gather(1, topk).float()
        n_true = truth.sum(-1)

        recall = hits.sum(-1) / n_true.clamp(max=k)
        dcg = (hits * discount).sum(-1)
        idcg = idcg_table[n_true.clamp(max=k) - 1]
        recall_sum += recall.sum().item()
        ndcg_sum += (dcg / idcg).sum().item()
        n_users += batch_users.numel()

    model.train()
    return recall_sum / n_users, ndcg_sum / n_users


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    data = torch.load(args.data)
    num_users, num_items = data["num_users"], data["num_items"]
    train_edges = data["train"].to(device)
    val_edges = data["val"].to(device)
    test_edges = data["test"].to(device)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"users={num_users} items={num_items} train={train_edges.size(1)} "
              f"val={val_edges.size(1)} test={test_edges.size(1)} world={world_size}", flush=True)

    # message passing graph: user <-> item, items shifted by num_users
    msg = torch.stack([train_edges[0], train_edges[1] + num_users])
    msg_edge_index = to_undirected(msg, num_nodes=num_users + num_items)

    model = BPRLightGCN(num_users, num_items, args.dim, args.layers).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    per_rank_bs = args.batch_size // world_size
    edge_ids = range(train_edges.size(1))
    sampler = DistributedSampler(edge_ids, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(edge_ids, batch_size=per_rank_bs, sampler=sampler, drop_last=True)

    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed * 1000 + rank)  # different negatives on each rank

    best_ndcg, history = -1.0, []
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for idx in loader:
            idx = idx.to(device, non_blocking=True)
            users = train_edges[0, idx]
            pos_items = train_edges[1, idx]
            neg_items = torch.randint(0, num_items, (idx.numel(),), device=device, generator=gen)

            pos_score, neg_score, reg = model(msg_edge_index, users, pos_items, neg_items)
            bpr = F.softplus(neg_score - pos_score).mean()
            loss = bpr + args.reg * reg

            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum[0] += bpr.detach()
            loss_sum[1] += 1

        dist.all_reduce(loss_sum)
        train_bpr = (loss_sum[0] / loss_sum[1]).item()

        if epoch % args.eval_every == 0 or epoch == args.epochs:
            recall, ndcg = evaluate(model, msg_edge_index, train_edges, val_edges,
                                    args.k, args.eval_users, rank, world_size, device)
            if rank == 0:
                history.append({"epoch": epoch, "bpr": train_bpr,
                                f"recall@{args.k}": recall, f"ndcg@{args.k}": ndcg})
                print(f"epoch {epoch:3d} bpr {train_bpr:.4f} recall@{args.k} {recall:.4f} "
                      f"ndcg@{args.k} {ndcg:.4f} ({time.time() - t0:.1f}s)", flush=True)
                if ndcg > best_ndcg:
                    best_ndcg = ndcg
                    torch.save({"epoch": epoch, "model": model.module.state_dict(), "args": vars(args)},
                               os.path.join(args.out, "best.pt"))
        elif rank == 0:
            print(f"epoch {epoch:3d} bpr {train_bpr:.4f} ({time.time() - t0:.1f}s)", flush=True)

    dist.barrier()
    ckpt = torch.load(os.path.join(args.out, "best.pt"), map_location=device)
    model.module.load_state_dict(ckpt["model"])
    recall, ndcg = evaluate(model, msg_edge_index, train_edges, test_edges,
                            args.k, args.eval_users, rank, world_size, device)
    if rank == 0:
        print(f"test (best epoch {ckpt['epoch']}): recall@{args.k} {recall:.4f} ndcg@{args.k} {ndcg:.4f}")
        with open(os.path.join(args.out, "metrics.json"), "w") as f:
            json.dump({"history": history, "test": {"recall": recall, "ndcg": ndcg}}, f, indent=2)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
