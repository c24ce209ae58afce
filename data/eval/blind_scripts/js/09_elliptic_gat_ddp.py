"""Illicit-transaction detection on the Elliptic bitcoin graph with GATv2 + neighbour sampling.

Temporal protocol from the Elliptic paper: time steps 1-34 train, 35-49 test.
The last time steps of the training range are held out for model selection.

    torchrun --nproc_per_node=4 09_elliptic_gat_ddp.py --root /data/elliptic
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import average_precision_score, f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.datasets import EllipticBitcoinDataset
from torch_geometric.loader import NeighborLoader
from torch_geometric.nn import GATv2Conv


def get_args():
    parser = argparse.ArgumentParser(description="Elliptic GATv2 DDP")
    parser.add_argument("--root", default="/data/elliptic")
    parser.add_argument("--save", default="checkpoints/elliptic_gat.pt")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--val-frac", type=float, default=0.15)
    parser.add_argument("--illicit-weight", type=float, default=3.0)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


class GAT(nn.Module):
    def __init__(self, in_dim, hidden, heads, dropout=0.3):
        super().__init__()
        self.conv1 = GATv2Conv(in_dim, hidden, heads=heads, dropout=dropout)
        self.conv2 = GATv2Conv(hidden * heads, hidden, heads=1, dropout=dropout)
        self.skip = nn.Linear(in_dim, hidden)
        self.cls = nn.Linear(hidden, 2)
        self.dropout = dropout

    def forward(self, x, edge_index):
        h = F.elu(self.conv1(x, edge_index))
        h = F.dropout(h, self.dropout, self.training)
        h = F.elu(self.conv2(h, edge_index) + self.skip(x))
        return self.cls(h)


@torch.no_grad()
def full_graph_scores(module, data, device):
    module.eval()
    logits = module(data.x.to(device), data.edge_index.to(device))
    return torch.softmax(logits, dim=-1)[:, 1].cpu()


def report(prob, y, mask, thr=0.5):
    p, t = prob[mask].numpy(), y[mask].numpy()
    return {"ap": average_precision_score(t, p), "f1_illicit": f1_score(t, p > thr, pos_label=1)}


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    torch.manual_seed(0)

    # one process downloads / processes, the rest wait and read the processed files
    if rank != 0:
        dist.barrier()
    dataset = EllipticBitcoinDataset(args.root)
    if rank == 0:
        dist.barrier()
    data = dataset[0]

    # nodes are stored in time order; hold out the tail of the labelled training period
    train_nodes = data.train_mask.nonzero().view(-1)
    n_val = int(len(train_nodes) * args.val_frac)
    val_nodes, train_nodes = train_nodes[-n_val:], train_nodes[:-n_val]
    val_mask = torch.zeros_like(data.train_mask)
    val_mask[val_nodes] = True

    perm = torch.randperm(len(train_nodes), generator=torch.Generator().manual_seed(1))
    chunk = len(train_nodes) // world
    my_nodes = train_nodes[perm[rank * chunk:(rank + 1) * chunk]]

    loader = NeighborLoader(data, num_neighbors=[25, 15], input_nodes=my_nodes, batch_size=args.batch_size,
                            shuffle=True, num_workers=4, drop_last=True)

    model = GAT(data.num_features, args.hidden, args.heads).to(device)
    model = DDP(model, device_ids=[args.local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=5e-4)
    class_w = torch.tensor([1.0, args.illicit_weight], device=device)

    best_ap, best_epoch = 0.0, -1
    for epoch in range(1, args.epochs + 1):
        model.train()
        t0 = time.time()
        total = torch.zeros(2, device=device)
        for batch in loader:
            batch = batch.to(device)
            out = model(batch.x, batch.edge_index)[:batch.batch_size]
            y = batch.y[:batch.batch_size]
            loss = F.cross_entropy(out, y, weight=class_w)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += torch.tensor([loss.item() * y.numel(), y.numel()], device=device)
        dist.all_reduce(total)

        if epoch % 5 == 0 or epoch == args.epochs:
            prob = full_graph_scores(model.module, data, device)
            val = report(prob, data.y, val_mask)
            if rank == 0:
                print(f"epoch {epoch:3d} loss {total[0].item() / total[1].item():.4f} "
                      f"val AP {val['ap']:.4f} F1 {val['f1_illicit']:.4f} ({time.time() - t0:.1f}s)", flush=True)
                if val["ap"] > best_ap:
                    best_ap, best_epoch = val["ap"], epoch
                    os.makedirs(os.path.dirname(args.save) or ".", exist_ok=True)
                    torch.save(model.module.state_dict(), args.save)
            dist.barrier()

    if rank == 0:
        model.module.load_state_dict(torch.load(args.save, map_location=device))
        prob = full_graph_scores(model.module, data, device)
        test = report(prob, data.y, data.test_mask)
        print(f"best epoch {best_epoch}: test AP {test['ap']:.4f} illicit F1 {test['f1_illicit']:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
