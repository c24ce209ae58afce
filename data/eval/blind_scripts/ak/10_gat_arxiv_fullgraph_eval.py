#!/usr/bin/env python
"""GAT on ogbn-arxiv: mini-batch training on several GPUs, full-graph test.

Training uses PyG NeighborLoader over each rank's slice of the training papers.
The best model (by validation accuracy) is kept, and at the end rank 0 reloads it
and runs a single full-graph forward on the whole citation graph for the
official OGB evaluator numbers.

    torchrun --nproc_per_node=4 10_gat_arxiv_fullgraph_eval.py --epochs 100
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch_geometric.transforms as T
from ogb.nodeproppred import Evaluator, PygNodePropPredDataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.loader import NeighborLoader
from torch_geometric.nn import GATConv


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="data/ogb")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--dropout", type=float, default=0.5)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--fanout", type=int, nargs="+", default=[15, 10, 5])
    p.add_argument("--out", default="ckpt/gat_arxiv")
    return p.parse_args()


class GAT(nn.Module):
    def __init__(self, in_dim, hidden, out_dim, heads, layers, dropout):
        super().__init__()
        self.convs = nn.ModuleList()
        self.bns = nn.ModuleList()
        d = in_dim
        for i in range(layers - 1):
            self.convs.append(GATConv(d, hidden, heads=heads, dropout=dropout))
            self.bns.append(nn.LayerNorm(hidden * heads))
            d = hidden * heads
        self.convs.append(GATConv(d, out_dim, heads=1, concat=False, dropout=dropout))
        self.dropout = dropout

    def forward(self, x, edge_index):
        for conv, bn in zip(self.convs[:-1], self.bns):
            x = conv(x, edge_index)
            x = F.elu(bn(x))
            x = F.dropout(x, p=self.dropout, training=self.training)
        return self.convs[-1](x, edge_index)


@torch.no_grad()
def sampled_eval(model, loader, device):
    model.eval()
    stats = torch.zeros(2, device=device)
    for batch in loader:
        batch = batch.to(device)
        out = model(batch.x, batch.edge_index)[: batch.batch_size]
        y = batch.y[: batch.batch_size].view(-1)
        stats[0] += (out.argmax(-1) == y).sum()
        stats[1] += batch.batch_size
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[1]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(0)

    dataset = PygNodePropPredDataset("ogbn-arxiv", root=args.root,
                                     transform=T.Compose([T.ToUndirected(), T.AddSelfLoops()]))
    data = dataset[0]
    split = dataset.get_idx_split()
    train_idx, val_idx, test_idx = split["train"], split["valid"], split["test"]

    # same number of seeds on every rank; a fresh permutation each epoch
    per_rank = train_idx.numel() // world
    val_loader = NeighborLoader(data, input_nodes=val_idx[rank::world], num_neighbors=args.fanout,
                                batch_size=4096, shuffle=False, num_workers=4)

    model = GAT(data.num_features, args.hidden, dataset.num_classes, args.heads,
                args.layers, args.dropout).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    best_path = os.path.join(args.out, "best.pt")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best_val = 0.0
    for epoch in range(1, args.epochs + 1):
        g = torch.Generator().manual_seed(epoch)
        perm = train_idx[torch.randperm(train_idx.numel(), generator=g)]
        my_seeds = perm[rank * per_rank:(rank + 1) * per_rank]
        loader = NeighborLoader(data, input_nodes=my_seeds, num_neighbors=args.fanout,
                                batch_size=args.batch_size, shuffle=False, num_workers=4,
                                drop_last=True)
        t0 = time.time()
        total = 0.0
        for batch in loader:
            batch = batch.to(device, non_blocking=True)
            out = model(batch.x, batch.edge_index)[: batch.batch_size]
            loss = F.cross_entropy(out, batch.y[: batch.batch_size].view(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()

        if epoch % 5 == 0:
            val_acc = sampled_eval(model, val_loader, device)
            if rank == 0:
                print(f"epoch {epoch:03d} loss {total / len(loader):.4f} val {val_acc:.4f} "
                      f"({time.time() - t0:.1f}s)", flush=True)
                if val_acc > best_val:
                    best_val = val_acc
                    torch.save(model.state_dict(), best_path)
            dist.barrier()

    if rank == 0:
        # full-graph inference with the best weights, one GPU is enough for arxiv
        final = GAT(data.num_features, args.hidden, dataset.num_classes, args.heads,
                    args.layers, args.dropout).to(device)
        final.load_state_dict(torch.load(best_path, map_location=device))
        final.eval()
        with torch.no_grad():
            out = final(data.x.to(device), data.edge_index.to(device))
        y_pred = out.argmax(-1, keepdim=True).cpu()
        evaluator = Evaluator("ogbn-arxiv")
        res = {}
        for name, idx in (("train", train_idx), ("valid", val_idx), ("test", test_idx)):
            res[name] = evaluator.eval({"y_true": data.y[idx], "y_pred": y_pred[idx]})["acc"]
        print(f"full-graph: train {res['train']:.4f} valid {res['valid']:.4f} "
              f"test {res['test']:.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
