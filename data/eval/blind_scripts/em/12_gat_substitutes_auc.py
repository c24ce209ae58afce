#!/usr/bin/env python
"""Substitute-product link prediction with GATv2 on the item graph.

Edges are "viewed A then bought B instead" pairs, edge_attr = [log price ratio, same brand,
same leaf category]. Training uses LinkNeighborLoader mini-batches; each GPU takes its own
slice of the supervision edges.

    torchrun --nproc_per_node=8 gat_substitutes.py --data /mnt/graphs/substitutes/v4/split.pt
"""
import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.loader import LinkNeighborLoader
from torch_geometric.nn import GATv2Conv
from torchmetrics.classification import BinaryAUROC, BinaryAveragePrecision


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--output-dir", default="/mnt/experiments/gat_substitutes")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=1024, help="per GPU, lr tuned for 8 GPUs")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=1e-5)
    parser.add_argument("--num-workers", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class GATLink(nn.Module):
    def __init__(self, in_dim, edge_dim, hidden, heads):
        super().__init__()
        self.conv1 = GATv2Conv(in_dim, hidden, heads=heads, edge_dim=edge_dim)
        self.conv2 = GATv2Conv(hidden * heads, hidden, heads=1, edge_dim=edge_dim)
        self.edge_mlp = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x, edge_index, edge_attr, edge_label_index):
        x = F.elu(self.conv1(x, edge_index, edge_attr))
        x = F.dropout(x, p=0.2, training=self.training)
        x = self.conv2(x, edge_index, edge_attr)
        src, dst = x[edge_label_index[0]], x[edge_label_index[1]]
        return self.edge_mlp(torch.cat([src * dst, (src - dst).abs()], dim=-1)).view(-1)


def build_loader(data, eli, lbl, batch_size, workers, train):
    return LinkNeighborLoader(
        data,
        num_neighbors=[12, 6],
        edge_label_index=eli,
        edge_label=lbl,
        neg_sampling_ratio=1.0 if train else None,
        batch_size=batch_size,
        shuffle=train,
        drop_last=train,
        num_workers=workers,
        persistent_workers=train and workers > 0,
    )


@torch.no_grad()
def evaluate(model, data, args, rank, world_size, device):
    model.eval()
    auroc = BinaryAUROC().to(device)
    ap = BinaryAveragePrecision().to(device)
    eli = data.edge_label_index[:, rank::world_size]
    lbl = data.edge_label[rank::world_size]
    for batch in build_loader(data, eli, lbl, 4096, args.num_workers, train=False):
        batch = batch.to(device)
        out = model.module(batch.x, batch.edge_index, batch.edge_attr, batch.edge_label_index)
        auroc.update(out.sigmoid(), batch.edge_label.long())
        ap.update(out.sigmoid(), batch.edge_label.long())
    # torchmetrics syncs the states across the process group in compute()
    res = {"auc": auroc.compute().item(), "ap": ap.compute().item()}
    model.train()
    return res


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device(f"cuda:{args.local_rank}")
    seed_everything(args.seed)

    train_data, val_data, test_data = torch.load(args.data)
    n_sup = train_data.edge_label_index.size(1)
    shard = n_sup // world_size
    order = torch.randperm(n_sup, generator=torch.Generator().manual_seed(args.seed))
    mine = order[rank * shard:(rank + 1) * shard]
    train_loader = build_loader(train_data, train_data.edge_label_index[:, mine],
                                train_data.edge_label[mine], args.batch_size, args.num_workers, train=True)

    model = GATLink(train_data.num_features, train_data.edge_attr.size(-1), args.hidden, args.heads).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=2)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"world {world_size} | {shard} supervision edges per rank | {len(train_loader)} steps", flush=True)

    best_auc = 0.0
    for epoch in range(args.epochs):
        model.train()
        start = time.time()
        loss_acc = torch.zeros(2, device=device)
        for batch in train_loader:
            batch = batch.to(device, non_blocking=True)
            out = model(batch.x, batch.edge_index, batch.edge_attr, batch.edge_label_index)
            loss = F.binary_cross_entropy_with_logits(out, batch.edge_label.float())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(loss_acc)

        val = evaluate(model, val_data, args, rank, world_size, device)
        scheduler.step(val["auc"])
        if rank == 0:
            print(f"epoch {epoch:02d} loss {(loss_acc[0] / loss_acc[1]).item():.4f} "
                  f"val auc {val['auc']:.4f} ap {val['ap']:.4f} lr {optimizer.param_groups[0]['lr']:.1e} "
                  f"({time.time() - start:.0f}s)", flush=True)
            if val["auc"] > best_auc:
                best_auc = val["auc"]
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "val": val},
                           os.path.join(args.output_dir, "best.pt"))

    dist.barrier()
    ckpt = torch.load(os.path.join(args.output_dir, "best.pt"), map_location=device)
    model.module.load_state_dict(ckpt["model"])
    test = evaluate(model, test_data, args, rank, world_size, device)
    if rank == 0:
        print(f"test (epoch {ckpt['epoch']}): auc {test['auc']:.4f} ap {test['ap']:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
