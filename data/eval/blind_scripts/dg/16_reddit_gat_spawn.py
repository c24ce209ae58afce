"""GAT on Reddit with neighbour sampling; workers started with mp.spawn.

    python 16_reddit_gat_spawn.py --world_size 4 --epochs 15
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.datasets import Reddit
from torch_geometric.loader import NeighborLoader
from torch_geometric.nn import GATConv


class GAT(torch.nn.Module):
    def __init__(self, in_dim, hidden, out_dim, heads=4, dropout=0.4):
        super().__init__()
        self.conv1 = GATConv(in_dim, hidden, heads=heads, dropout=dropout)
        self.conv2 = GATConv(hidden * heads, hidden, heads=heads, dropout=dropout)
        self.conv3 = GATConv(hidden * heads, out_dim, heads=1, concat=False, dropout=dropout)
        self.skip = torch.nn.Linear(in_dim, hidden * heads)
        self.dropout = dropout

    def forward(self, x, edge_index):
        h = F.elu(self.conv1(x, edge_index) + self.skip(x))
        h = F.dropout(h, p=self.dropout, training=self.training)
        h = F.elu(self.conv2(h, edge_index) + h)
        h = F.dropout(h, p=self.dropout, training=self.training)
        return self.conv3(h, edge_index)


def ddp_setup(rank, world_size, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    counts = torch.zeros(2, device=device)
    for batch in loader:
        batch = batch.to(device)
        pred = model(batch.x, batch.edge_index)[: batch.batch_size].argmax(-1)
        counts[0] += (pred == batch.y[: batch.batch_size]).sum()
        counts[1] += batch.batch_size
    dist.all_reduce(counts)
    return (counts[0] / counts[1]).item()


def train_worker(world_size, rank, dataset, cfg):
    ddp_setup(rank, world_size, cfg.port)
    device = torch.device("cuda", rank)
    data = dataset[0]

    def split_mask(mask):
        idx = mask.nonzero(as_tuple=False).view(-1)
        per = idx.numel() // world_size
        return idx[rank * per:(rank + 1) * per]

    train_idx = split_mask(data.train_mask)
    val_idx = split_mask(data.val_mask)
    test_idx = split_mask(data.test_mask)

    loader_args = dict(num_neighbors=[20, 10, 5], num_workers=4)
    train_loader = NeighborLoader(data, input_nodes=train_idx, batch_size=cfg.batch_size,
                                  shuffle=True, drop_last=True, persistent_workers=True,
                                  **loader_args)
    val_loader = NeighborLoader(data, input_nodes=val_idx, batch_size=2048, **loader_args)
    test_loader = NeighborLoader(data, input_nodes=test_idx, batch_size=2048, **loader_args)

    model = GAT(dataset.num_features, cfg.hidden, dataset.num_classes, heads=cfg.heads).to(device)
    model = DDP(model, device_ids=[rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=5e-4)

    best_val = 0.0
    for epoch in range(1, cfg.epochs + 1):
        model.train()
        t0 = time.time()
        acc_loss = torch.zeros(2, device=device)
        for batch in train_loader:
            batch = batch.to(device)
            optimizer.zero_grad()
            out = model(batch.x, batch.edge_index)[: batch.batch_size]
            loss = F.cross_entropy(out, batch.y[: batch.batch_size])
            loss.backward()
            optimizer.step()
            acc_loss[0] += loss.detach()
            acc_loss[1] += 1
        dist.all_reduce(acc_loss)
        val_acc = evaluate(model.module, val_loader, device)
        if rank == 0:
            print(f"Epoch {epoch:02d}  loss {(acc_loss[0] / acc_loss[1]).item():.4f}  "
                  f"val {val_acc:.4f}  ({time.time() - t0:.1f}s)", flush=True)
            if val_acc > best_val:
                best_val = val_acc
                torch.save(model.module.state_dict(), cfg.ckpt)
        dist.barrier()

    model.module.load_state_dict(torch.load(cfg.ckpt, map_location=device))
    test_acc = evaluate(model.module, test_loader, device)
    if rank == 0:
        print(f"best val {best_val:.4f}  test {test_acc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="data/Reddit")
    parser.add_argument("--world_size", type=int, default=torch.cuda.device_count())
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch_size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--port", type=int, default=29500)
    parser.add_argument("--ckpt", default="gat_reddit_best.pt")
    cfg = parser.parse_args()

    dataset = Reddit(cfg.root)
    world_size = min(cfg.world_size, torch.cuda.device_count())
    mp.spawn(train_worker, args=(world_size, dataset, cfg), nprocs=world_size, join=True)
