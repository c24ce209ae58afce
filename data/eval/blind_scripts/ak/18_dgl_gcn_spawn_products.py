#!/usr/bin/env python
"""Cluster-GCN style mini-batch GCN on ogbn-products with DGL, spawned workers.

The graph is METIS-partitioned once into --num-parts clusters in the parent;
each step a worker merges --parts-per-batch random clusters into a subgraph
(ClusterGCN sampling). Workers are started with torch.multiprocessing.

    python 18_dgl_gcn_spawn_products.py --gpus 4 --num-parts 1000 --epochs 40
"""
import argparse
import os
import time

import dgl
import dgl.nn as dglnn
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from ogb.nodeproppred import DglNodePropPredDataset, Evaluator
from torch.nn.parallel import DistributedDataParallel as DDP


class GCN(nn.Module):
    def __init__(self, in_feats, hidden, n_classes, n_layers, dropout):
        super().__init__()
        dims = [in_feats] + [hidden] * (n_layers - 1) + [n_classes]
        self.layers = nn.ModuleList(
            [dglnn.GraphConv(dims[i], dims[i + 1], norm="both", allow_zero_in_degree=True)
             for i in range(n_layers)])
        self.norms = nn.ModuleList([nn.LayerNorm(hidden) for _ in range(n_layers - 1)])
        self.dropout = nn.Dropout(dropout)

    def forward(self, g, x):
        h = x
        for i, layer in enumerate(self.layers):
            h = layer(g, h)
            if i < len(self.layers) - 1:
                h = self.dropout(F.relu(self.norms[i](h)))
        return h


def run(world_size, rank, g, data, args):
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}",
                            world_size=world_size, rank=rank)
    num_classes, train_idx, val_idx, test_idx = data

    sampler = dgl.dataloading.ClusterGCNSampler(
        g, args.num_parts, cache_path=args.partition_cache,
        prefetch_ndata=["feat", "label", "train_mask", "val_mask", "test_mask"])
    loader = dgl.dataloading.DataLoader(
        g, torch.arange(args.num_parts), sampler, device=device,
        batch_size=args.parts_per_batch, shuffle=True, drop_last=True,
        num_workers=0, use_ddp=True, use_uva=True)
    eval_loader = dgl.dataloading.DataLoader(
        g, torch.arange(args.num_parts), sampler, device=device,
        batch_size=args.parts_per_batch, shuffle=False, drop_last=False,
        num_workers=0, use_ddp=True, use_uva=True)

    torch.manual_seed(args.seed)
    model = GCN(g.ndata["feat"].shape[1], args.hidden, num_classes, args.layers,
                args.dropout).to(device)
    model = DDP(model, device_ids=[rank], output_device=rank)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    evaluator = Evaluator("ogbn-products")

    best_val, best_test = 0.0, 0.0
    for epoch in range(args.epochs):
        t0 = time.time()
        model.train()
        loss_sum = torch.zeros(2, device=device)
        for sg in loader:
            x = sg.ndata["feat"]
            y = sg.ndata["label"].view(-1)
            m = sg.ndata["train_mask"].bool()
            logits = model(sg, x)
            loss = F.cross_entropy(logits[m], y[m]) if m.any() else logits.sum() * 0.0
            opt.zero_grad()
            loss.backward()
            opt.step()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(loss_sum)

        if (epoch + 1) % args.eval_every == 0:
            # cluster-wise evaluation: every rank scores its share of the clusters
            model.eval()
            correct = torch.zeros(4, device=device)
            with torch.no_grad():
                for sg in eval_loader:
                    pred = model(sg, sg.ndata["feat"]).argmax(1)
                    y = sg.ndata["label"].view(-1)
                    for j, key in enumerate(("val_mask", "test_mask")):
                        mk = sg.ndata[key].bool()
                        correct[2 * j] += (pred[mk] == y[mk]).sum()
                        correct[2 * j + 1] += mk.sum()
            dist.all_reduce(correct)
            val_acc = (correct[0] / correct[1]).item()
            test_acc = (correct[2] / correct[3]).item()
            if val_acc > best_val:
                best_val, best_test = val_acc, test_acc
                if rank == 0:
                    torch.save(model.module.state_dict(), args.ckpt)
            if rank == 0:
                print(f"epoch {epoch:03d} loss {(loss_sum[0] / loss_sum[1]).item():.4f} "
                      f"val {val_acc:.4f} test {test_acc:.4f} (best {best_val:.4f}/{best_test:.4f}) "
                      f"{time.time() - t0:.1f}s", flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--num-parts", type=int, default=1000)
    ap.add_argument("--parts-per-batch", type=int, default=32)
    ap.add_argument("--partition-cache", default="cache/products_metis_1000.pkl")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--dropout", type=float, default=0.3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=29533)
    ap.add_argument("--ckpt", default="ckpt/cluster_gcn_products.pt")
    args = ap.parse_args()

    dataset = DglNodePropPredDataset("ogbn-products")
    g, labels = dataset[0]
    split = dataset.get_idx_split()
    n = g.num_nodes()
    for name, key in (("train", "train_mask"), ("valid", "val_mask"), ("test", "test_mask")):
        mask = torch.zeros(n, dtype=torch.bool)
        mask[split[name]] = True
        g.ndata[key] = mask
    g.ndata["label"] = labels.view(-1)
    g = dgl.add_self_loop(dgl.remove_self_loop(g))
    os.makedirs(os.path.dirname(args.partition_cache), exist_ok=True)
    os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
    # run METIS once here so the workers only read the cached partition
    dgl.dataloading.ClusterGCNSampler(g, args.num_parts, cache_path=args.partition_cache)
    g.create_formats_()

    data = (dataset.num_classes, split["train"], split["valid"], split["test"])
    world_size = args.gpus
    mp.spawn(run, args=(world_size, g, data, args), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
