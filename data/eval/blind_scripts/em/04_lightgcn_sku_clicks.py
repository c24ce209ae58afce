#!/usr/bin/env python
"""LightGCN retrieval model trained on 30 days of add-to-cart events.

The last day is held out for Recall@K / NDCG@K. Items that are in the catalogue but
had no events are kept so that they get an (untrained) embedding row for serving.

    torchrun --standalone --nproc_per_node=8 lightgcn_sku_clicks.py \
        --events /mnt/lake/events/atc_30d.parquet --catalog /mnt/lake/catalog/skus.parquet
"""
import argparse
import json
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.nn import LightGCN


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--events", required=True)
    p.add_argument("--catalog", required=True)
    p.add_argument("--out", default="/mnt/experiments/lightgcn_atc")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--global-batch", type=int, default=32768)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--lambda-reg", type=float, default=1e-4)
    p.add_argument("--k", type=int, default=50)
    p.add_argument("--min-user-events", type=int, default=3)
    return p.parse_args()


def load_graph(events_path, catalog_path, min_user_events):
    # user_id / sku are string keys from the lake ("u:8f3a...", "SKU-0041873-BLK")
    ev = pd.read_parquet(events_path, columns=["user_id", "sku", "ts"])
    counts = ev.groupby("user_id")["sku"].transform("size")
    ev = ev[counts >= min_user_events]
    catalog = pd.read_parquet(catalog_path, columns=["sku"])

    all_skus = set(ev["sku"]) | set(catalog["sku"])
    sku2idx = {sku: i for i, sku in enumerate(all_skus)}
    users = ev["user_id"].astype("category")
    ev = ev.assign(u=users.cat.codes.astype(np.int64), i=ev["sku"].map(sku2idx).astype(np.int64))

    cutoff = ev["ts"].max().normalize()  # midnight of the last day
    train = ev[ev["ts"] < cutoff].drop_duplicates(["u", "i"])
    val = ev[ev["ts"] >= cutoff].drop_duplicates(["u", "i"])
    val = val[val["u"].isin(train["u"].unique())]

    def to_t(df):
        return torch.from_numpy(np.stack([df["u"].to_numpy(), df["i"].to_numpy()]))

    return {
        "num_users": len(users.cat.categories),
        "num_items": len(sku2idx),
        "train": to_t(train),
        "val": to_t(val),
        "sku2idx": sku2idx,
    }


@torch.no_grad()
def recall_ndcg(model, edge_index, train_ei, val_ei, num_users, num_items, k, rank, world, device):
    emb = model.module.get_embedding(edge_index)
    u_emb, i_emb = emb[:num_users], emb[num_users:]
    eval_users = torch.unique(val_ei[0])[rank::world]
    disc = 1.0 / torch.log2(torch.arange(k, device=device, dtype=torch.float) + 2)
    acc = torch.zeros(3, device=device)  # recall, ndcg, count
    for users in eval_users.split(2048):
        pos_of = torch.full((num_users,), -1, device=device, dtype=torch.long)
        pos_of[users] = torch.arange(users.numel(), device=device)
        scores = u_emb[users] @ i_emb.T
        tr = pos_of[train_ei[0]]
        m = tr >= 0
        scores[tr[m], train_ei[1, m]] = -1e9
        gt = torch.zeros_like(scores, dtype=torch.bool)
        va = pos_of[val_ei[0]]
        m = va >= 0
        gt[va[m], val_ei[1, m]] = True
        top = scores.topk(k, dim=1).indices
        hit = gt.gather(1, top).float()
        n_gt = gt.sum(1).clamp(max=k)
        acc[0] += (hit.sum(1) / n_gt).sum()
        idcg = torch.stack([disc[:n].sum() for n in n_gt.tolist()])
        acc[1] += ((hit * disc).sum(1) / idcg).sum()
        acc[2] += users.numel()
    dist.all_reduce(acc)
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    g = load_graph(args.events, args.catalog, args.min_user_events)
    nu, ni = g["num_users"], g["num_items"]
    train_ei = g["train"].to(device)
    val_ei = g["val"].to(device)
    # bipartite -> homogeneous, both directions
    src = torch.cat([train_ei[0], train_ei[1] + nu])
    dst = torch.cat([train_ei[1] + nu, train_ei[0]])
    edge_index = torch.stack([src, dst])

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "sku2idx.json"), "w") as f:
            json.dump(g["sku2idx"], f)
        print(f"users {nu:,} items {ni:,} train {train_ei.size(1):,} val {val_ei.size(1):,}", flush=True)

    model = DDP(LightGCN(nu + ni, args.dim, args.layers).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    ds = TensorDataset(torch.arange(train_ei.size(1)))
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.global_batch // world, sampler=sampler, pin_memory=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for (idx,) in loader:
            idx = idx.to(device, non_blocking=True)
            u = train_ei[0, idx]
            pos = train_ei[1, idx] + nu
            neg = torch.randint(nu, nu + ni, (idx.numel(),), device=device)
            label_index = torch.stack([torch.cat([u, u]), torch.cat([pos, neg])])
            pos_rank, neg_rank = model(edge_index, label_index).chunk(2)
            node_id = torch.cat([u, pos, neg]).unique()
            loss = model.module.recommendation_loss(pos_rank, neg_rank, node_id=node_id,
                                                    lambda_reg=args.lambda_reg)
            opt.zero_grad()
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)

        model.eval()
        rec, ndcg = recall_ndcg(model, edge_index, train_ei, val_ei, nu, ni, args.k, rank, world, device)
        model.train()
        if rank == 0:
            print(f"[{epoch:02d}] loss {tot[0].item() / tot[1].item():.4f} recall@{args.k} {rec:.4f} "
                  f"ndcg@{args.k} {ndcg:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if ndcg > best:
                best = ndcg
                torch.save({"model": model.module.state_dict(), "num_users": nu, "num_items": ni},
                           os.path.join(args.out, "lightgcn_best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
