"""Suspicious-transfer (AML) edge classifier on a heterogeneous account graph.

node types : account, ip, bank
edge types : account -transfer-> account, account -login_from-> ip, account -holds_at-> bank (+ reverses)
labels     : per transfer edge, is_suspicious (~0.05% positive)

Legit transfers in the training window are downsampled (--neg-keep) with a fixed
seed so that every rank sees the same training edge set before it is sharded.
"""
import argparse
import logging
import os
from datetime import datetime

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch_geometric.transforms as T
from sklearn.metrics import average_precision_score, precision_recall_curve
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.data import HeteroData
from torch_geometric.loader import LinkNeighborLoader
from torch_geometric.nn import SAGEConv

logger = logging.getLogger(__name__)
TARGET = ("account", "transfer", "account")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/mnt/shared/aml")
    ap.add_argument("--out-dir", default="/mnt/shared/aml/runs/rgnn")
    ap.add_argument("--split-day", default="2024-03-01")
    ap.add_argument("--test-day", default="2024-04-01")
    ap.add_argument("--neg-keep", type=float, default=0.1)
    ap.add_argument("--hidden", type=int, default=96)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--batch-size", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--fanout", type=int, nargs=2, default=[20, 10])
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--seed", type=int, default=17)
    return ap.parse_args()


def load_graph(root, split_day, test_day):
    acc = pd.read_parquet(os.path.join(root, "accounts.parquet"))
    trf = pd.read_parquet(os.path.join(root, "transfers.parquet")).sort_values("ts", kind="stable")
    logins = pd.read_parquet(os.path.join(root, "logins.parquet"))

    acc_idx = pd.Index(acc["account_id"])
    ip_codes, ip_uniques = pd.factorize(logins["ip"])
    bank_codes, bank_uniques = pd.factorize(acc["bank_code"])

    data = HeteroData()
    feats = acc[["age_days", "kyc_level", "avg_balance", "n_products"]].fillna(0).to_numpy(np.float32)
    feats = (feats - feats.mean(0)) / (feats.std(0) + 1e-6)
    data["account"].x = torch.from_numpy(feats)
    data["ip"].x = torch.ones(len(ip_uniques), 1)
    data["bank"].x = torch.eye(len(bank_uniques))

    src = torch.from_numpy(acc_idx.get_indexer(trf["src_account"])).long()
    dst = torch.from_numpy(acc_idx.get_indexer(trf["dst_account"])).long()
    data[TARGET].edge_index = torch.stack([src, dst])
    amt = np.log1p(trf["amount"].to_numpy(np.float32))
    data[TARGET].edge_attr = torch.from_numpy(amt).unsqueeze(-1)
    data[TARGET].y = torch.from_numpy(trf["is_suspicious"].to_numpy(np.int64))
    ts = pd.to_datetime(trf["ts"])
    data[TARGET].split = torch.from_numpy(
        np.select([ts < split_day, ts < test_day], [0, 1], default=2).astype(np.int64)
    )

    la = torch.from_numpy(acc_idx.get_indexer(logins["account_id"])).long()
    data["account", "login_from", "ip"].edge_index = torch.stack([la, torch.from_numpy(ip_codes).long()])
    data["account", "holds_at", "bank"].edge_index = torch.stack(
        [torch.arange(len(acc)), torch.from_numpy(bank_codes).long()]
    )
    return T.ToUndirected()(data)


class RelGNN(nn.Module):
    """Two relation-wise SAGE layers; relations with no sampled edges are skipped."""

    def __init__(self, metadata, in_dims, hidden):
        super().__init__()
        node_types, edge_types = metadata
        self.enc = nn.ModuleDict({nt: nn.Linear(in_dims[nt], hidden) for nt in node_types})
        self.layers = nn.ModuleList()
        for _ in range(2):
            self.layers.append(nn.ModuleDict({"__".join(et): SAGEConv(hidden, hidden) for et in edge_types}))
        self.edge_mlp = nn.Sequential(
            nn.Linear(2 * hidden + 1, hidden), nn.ReLU(), nn.Dropout(0.2), nn.Linear(hidden, 1)
        )

    def forward(self, x_dict, edge_index_dict, label_index, label_attr):
        h = {nt: F.relu(self.enc[nt](x)) for nt, x in x_dict.items()}
        for layer in self.layers:
            out = {nt: torch.zeros_like(v) for nt, v in h.items()}
            for et, ei in edge_index_dict.items():
                if ei.size(1) == 0:
                    continue
                src, _, dst = et
                out[dst] = out[dst] + layer["__".join(et)]((h[src], h[dst]), ei)
            h = {nt: F.relu(v) + h[nt] for nt, v in out.items()}
        a = h["account"]
        z = torch.cat([a[label_index[0]], a[label_index[1]], label_attr], dim=-1)
        return self.edge_mlp(z).squeeze(-1)


def make_loader(data, eidx, fanout, batch_size, shuffle, workers):
    return LinkNeighborLoader(
        data,
        num_neighbors=fanout,
        edge_label_index=(TARGET, data[TARGET].edge_index[:, eidx]),
        edge_label=data[TARGET].y[eidx],
        edge_label_time=None,
        batch_size=batch_size,
        shuffle=shuffle,
        num_workers=workers,
        neg_sampling=None,
    )


def batch_edge_attr(batch, data, eidx):
    # input_id indexes into the eidx subset handed to the loader
    return data[TARGET].edge_attr[eidx[batch[TARGET].input_id]]


@torch.no_grad()
def score_split(model, data, eidx, args, device, rank, world):
    model.eval()
    mine = eidx[rank::world]
    loader = make_loader(data, mine, args.fanout, 8192, False, args.workers)
    probs, ys = [], []
    for batch in loader:
        attr = batch_edge_attr(batch, data, mine).to(device)
        batch = batch.to(device)
        logit = model.module(batch.x_dict, batch.edge_index_dict, batch[TARGET].edge_label_index, attr)
        probs.append(torch.sigmoid(logit).cpu().numpy())
        ys.append(batch[TARGET].edge_label.cpu().numpy())
    parts = [None] * world
    dist.all_gather_object(parts, (np.concatenate(probs), np.concatenate(ys)))
    p = np.concatenate([x[0] for x in parts])
    y = np.concatenate([x[1] for x in parts])
    return p, y


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(levelname)s %(message)s")

    cache = os.path.join(args.root, "cache", f"graph_{args.split_day}_{args.test_day}.pt")
    if rank == 0 and not os.path.exists(cache):
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        g = load_graph(args.root, args.split_day, args.test_day)
        torch.save(g, cache + ".tmp")
        os.replace(cache + ".tmp", cache)
    dist.barrier()
    data = torch.load(cache, map_location="cpu", weights_only=False)

    split = data[TARGET].split
    y = data[TARGET].y
    train_e = (split == 0).nonzero().view(-1)
    val_e = (split == 1).nonzero().view(-1)
    test_e = (split == 2).nonzero().view(-1)

    gen = torch.Generator().manual_seed(args.seed)
    pos = train_e[y[train_e] == 1]
    neg = train_e[y[train_e] == 0]
    neg = neg[torch.rand(neg.numel(), generator=gen) < args.neg_keep]
    train_e = torch.cat([pos, neg])
    train_e = train_e[torch.randperm(train_e.numel(), generator=gen)]
    shard = train_e.numel() // world
    my_train = train_e[rank * shard:(rank + 1) * shard]
    logger.info("train edges after downsampling: %d (pos %d)  per rank: %d", train_e.numel(), pos.numel(), shard)

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
    torch.manual_seed(args.seed)
    in_dims = {nt: data[nt].x.size(1) for nt in data.node_types}
    model = RelGNN(data.metadata(), in_dims, args.hidden).to(device)
    # login_from / holds_at edges are often absent from a sampled subgraph, so their convs get no grad
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = nn.BCEWithLogitsLoss(pos_weight=torch.tensor([5.0], device=device))

    train_loader = make_loader(data, my_train, args.fanout, args.batch_size, True, args.workers)
    steps = torch.tensor([len(train_loader)], device=device)
    dist.all_reduce(steps, op=dist.ReduceOp.MIN)
    steps_per_epoch = int(steps.item())

    best_ap = 0.0
    for epoch in range(args.epochs):
        model.train()
        running = torch.zeros(2, device=device)
        for step, batch in enumerate(train_loader):
            if step >= steps_per_epoch:
                break
            attr = batch_edge_attr(batch, data, my_train).to(device, non_blocking=True)
            batch = batch.to(device, non_blocking=True)
            logit = model(batch.x_dict, batch.edge_index_dict, batch[TARGET].edge_label_index, attr)
            loss = loss_fn(logit, batch[TARGET].edge_label.float())
            opt.zero_grad()
            loss.backward()
            opt.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(running)

        p, yv = score_split(model, data, val_e, args, device, rank, world)
        # undo the negative downsampling before thresholding
        p_cal = p / (p + (1 - p) / args.neg_keep)
        ap = float(average_precision_score(yv, p_cal))
        if rank == 0:
            prec, rec, thr = precision_recall_curve(yv, p_cal)
            r_at_p50 = rec[prec >= 0.5].max() if (prec >= 0.5).any() else 0.0
            logger.info("epoch %02d loss %.4f val AP %.4f recall@P50 %.3f",
                        epoch, (running[0] / running[1]).item(), ap, r_at_p50)
            if ap > best_ap:
                best_ap = ap
                torch.save({"state_dict": model.module.state_dict(), "epoch": epoch, "ap": ap,
                            "neg_keep": args.neg_keep, "saved": datetime.now().isoformat()},
                           os.path.join(args.out_dir, "best.pt"))
        dist.barrier()

    best = torch.load(os.path.join(args.out_dir, "best.pt"), map_location=device)
    model.module.load_state_dict(best["state_dict"])
    p, yt = score_split(model, data, test_e, args, device, rank, world)
    if rank == 0:
        p_cal = p / (p + (1 - p) / args.neg_keep)
        logger.info("test AP %.4f (best val AP %.4f @ epoch %d)", average_precision_score(yt, p_cal),
                    best["ap"], best["epoch"])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
