# -*- coding: utf-8 -*-
"""
Distributed mini-batch GraphSAGE for ogbn-products.

Usage:
    torchrun --nproc_per_node=4 12_products_sage_localrank.py --epochs 20 --lr 0.003
"""
import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from ogb.nodeproppred import Evaluator, PygNodePropPredDataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.loader import NeighborLoader
from torch_geometric.nn import SAGEConv
from tqdm import tqdm


def parse_args():
    parser = argparse.ArgumentParser(description="ogbn-products GraphSAGE (DDP)")
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--data_root", type=str, default="./dataset")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.003)
    parser.add_argument("--hidden_channels", type=int, default=256)
    parser.add_argument("--num_layers", type=int, default=3)
    parser.add_argument("--dropout", type=float, default=0.5)
    parser.add_argument("--batch_size", type=int, default=1024)
    parser.add_argument("--num_neighbors", type=int, nargs="+", default=[15, 10, 5])
    parser.add_argument("--num_workers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=2024)
    parser.add_argument("--save_dir", type=str, default="./ckpt")
    return parser.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class SAGE(nn.Module):
    def __init__(self, in_channels, hidden_channels, out_channels, num_layers, dropout):
        super(SAGE, self).__init__()
        self.convs = nn.ModuleList()
        self.convs.append(SAGEConv(in_channels, hidden_channels))
        for _ in range(num_layers - 2):
            self.convs.append(SAGEConv(hidden_channels, hidden_channels))
        self.convs.append(SAGEConv(hidden_channels, out_channels))
        self.dropout = dropout

    def reset_parameters(self):
        for conv in self.convs:
            conv.reset_parameters()

    def forward(self, x, edge_index):
        for conv in self.convs[:-1]:
            x = conv(x, edge_index)
            x = F.relu(x)
            x = F.dropout(x, p=self.dropout, training=self.training)
        return self.convs[-1](x, edge_index)


@torch.no_grad()
def test(model, loader, evaluator, device):
    model.eval()
    y_true, y_pred = [], []
    for batch in loader:
        batch = batch.to(device)
        out = model(batch.x, batch.edge_index)[: batch.batch_size]
        y_pred.append(out.argmax(dim=-1, keepdim=True))
        y_true.append(batch.y[: batch.batch_size])
    y_true = torch.cat(y_true)
    y_pred = torch.cat(y_pred)
    # collect the predictions of every rank before scoring
    sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([y_true.size(0)], device=device))
    max_n = int(max(s.item() for s in sizes))
    pad = max_n - y_true.size(0)
    both = torch.cat([y_true, y_pred], dim=1)
    both = F.pad(both, (0, 0, 0, pad), value=-1)
    gathered = [torch.empty_like(both) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, both)
    both = torch.cat([g[: int(s.item())] for g, s in zip(gathered, sizes)])
    return evaluator.eval({"y_true": both[:, :1].cpu(), "y_pred": both[:, 1:].cpu()})["acc"]


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda:%d" % args.local_rank)
    set_seed(args.seed)

    if rank == 0:
        _ = PygNodePropPredDataset(name="ogbn-products", root=args.data_root)
    dist.barrier()
    dataset = PygNodePropPredDataset(name="ogbn-products", root=args.data_root)
    data = dataset[0]
    split_idx = dataset.get_idx_split()
    evaluator = Evaluator(name="ogbn-products")

    train_idx = split_idx["train"]
    n_per = train_idx.size(0) // world_size
    train_idx = train_idx[rank * n_per:(rank + 1) * n_per]
    valid_idx = split_idx["valid"].tensor_split(world_size)[rank]
    test_idx = split_idx["test"].tensor_split(world_size)[rank]

    train_loader = NeighborLoader(data, input_nodes=train_idx, num_neighbors=args.num_neighbors,
                                  batch_size=args.batch_size, shuffle=True, drop_last=True,
                                  num_workers=args.num_workers, persistent_workers=True)
    valid_loader = NeighborLoader(data, input_nodes=valid_idx, num_neighbors=args.num_neighbors,
                                  batch_size=4096, num_workers=args.num_workers)
    test_loader = NeighborLoader(data, input_nodes=test_idx, num_neighbors=args.num_neighbors,
                                 batch_size=4096, num_workers=args.num_workers)

    model = SAGE(dataset.num_features, args.hidden_channels, dataset.num_classes,
                 args.num_layers, args.dropout).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    best_valid = 0
    for epoch in range(1, args.epochs + 1):
        model.train()
        t_start = time.time()
        loss_meter = torch.zeros(2, device=device)
        pbar = tqdm(train_loader, desc=f"Epoch {epoch:02d}", disable=(rank != 0))
        for batch in pbar:
            batch = batch.to(device)
            optimizer.zero_grad()
            out = model(batch.x, batch.edge_index)[: batch.batch_size]
            loss = F.nll_loss(F.log_softmax(out, dim=-1), batch.y[: batch.batch_size].squeeze(1))
            loss.backward()
            optimizer.step()
            loss_meter[0] += loss.detach()
            loss_meter[1] += 1
            pbar.set_postfix(loss=f"{loss.item():.4f}")
        dist.all_reduce(loss_meter)

        valid_acc = test(model.module, valid_loader, evaluator, device)
        test_acc = test(model.module, test_loader, evaluator, device)
        if rank == 0:
            print("Epoch: %02d, Loss: %.4f, Valid: %.2f%%, Test: %.2f%%, Time: %.1fs" % (
                epoch, (loss_meter[0] / loss_meter[1]).item(), 100 * valid_acc,
                100 * test_acc, time.time() - t_start))
            if valid_acc > best_valid:
                best_valid = valid_acc
                torch.save(model.module.state_dict(), os.path.join(args.save_dir, "sage_products.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
