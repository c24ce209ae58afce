"""GraphSAGE (max aggregation, JK) on ogbn-products with a preprocessed graph
cache: standardised features and degree features are computed once and saved
next to the OGB files so later runs start quickly.

    torchrun --standalone --nproc_per_node=8 10_sage_products_cached.py \
        --root /mnt/shared/ogb --cache_dir /mnt/shared/cache
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ogb.nodeproppred import PygNodePropPredDataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.loader import NeighborLoader
from torch_geometric.nn import JumpingKnowledge, SAGEConv
from torch_geometric.utils import degree


def load_graph(root, cache_dir):
    path = os.path.join(cache_dir, "ogbn_products_std_deg.pt")
    if os.path.exists(path):
        return torch.load(path)

    dataset = PygNodePropPredDataset("ogbn-products", root=root)
    data = dataset[0]
    split_idx = dataset.get_idx_split()

    x = data.x
    mean, std = x.mean(0, keepdim=True), x.std(0, keepdim=True).clamp_min(1e-6)
    deg = degree(data.edge_index[1], data.num_nodes).view(-1, 1)
    data.x = torch.cat([(x - mean) / std, torch.log1p(deg)], dim=-1)
    data.y = data.y.view(-1)
    num_classes = dataset.num_classes

    os.makedirs(cache_dir, exist_ok=True)
    torch.save((data, split_idx, num_classes), path)
    return data, split_idx, num_classes


class JKSAGE(torch.nn.Module):
    def __init__(self, in_channels, hidden, out_channels, num_layers, dropout):
        super().__init__()
        self.convs = torch.nn.ModuleList(
            [SAGEConv(in_channels if i == 0 else hidden, hidden, aggr="max")
             for i in range(num_layers)]
        )
        self.jk = JumpingKnowledge(mode="cat")
        self.lin = torch.nn.Linear(num_layers * hidden, out_channels)
        self.dropout = dropout

    def forward(self, x, edge_index):
        xs = []
        for conv in self.convs:
            x = F.relu(conv(x, edge_index))
            x = F.dropout(x, p=self.dropout, training=self.training)
            xs.append(x)
        return self.lin(self.jk(xs))


@torch.no_grad()
def accuracy(model, loader, device):
    model.eval()
    c = torch.zeros(2, device=device)
    for batch in loader:
        batch = batch.to(device)
        out = model(batch.x, batch.edge_index)[: batch.batch_size]
        c[0] += (out.argmax(-1) == batch.y[: batch.batch_size]).sum()
        c[1] += batch.batch_size
    dist.all_reduce(c)
    return (c[0] / c[1]).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="/mnt/shared/ogb")
    parser.add_argument("--cache_dir", default="/mnt/shared/cache")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--dropout", type=float, default=0.5)
    parser.add_argument("--fanout", default="15,10,5")
    parser.add_argument("--batch_size", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--epochs", type=int, default=25)
    parser.add_argument("--out", default="/mnt/shared/runs/jksage_products")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    data, split_idx, num_classes = load_graph(args.root, args.cache_dir)

    def part(idx):
        k = idx.numel() // world
        return idx[rank * k:(rank + 1) * k]

    fanout = [int(v) for v in args.fanout.split(",")]
    train_loader = NeighborLoader(data, input_nodes=part(split_idx["train"]),
                                  num_neighbors=fanout, batch_size=args.batch_size,
                                  shuffle=True, drop_last=True, num_workers=4,
                                  persistent_workers=True)
    valid_loader = NeighborLoader(data, input_nodes=part(split_idx["valid"]),
                                  num_neighbors=fanout, batch_size=4096, num_workers=2)
    test_loader = NeighborLoader(data, input_nodes=part(split_idx["test"]),
                                 num_neighbors=fanout, batch_size=4096, num_workers=2)

    model = JKSAGE(data.num_features, args.hidden, num_classes, args.layers,
                   args.dropout).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best_valid, test_at_best = 0.0, 0.0
    for epoch in range(1, args.epochs + 1):
        model.train()
        start = time.time()
        s = torch.zeros(2, device=device)
        for batch in train_loader:
            batch = batch.to(device)
            optimizer.zero_grad()
            out = model(batch.x, batch.edge_index)[: batch.batch_size]
            loss = F.cross_entropy(out, batch.y[: batch.batch_size])
            loss.backward()
            optimizer.step()
            s += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(s)

        valid_acc = accuracy(model.module, valid_loader, device)
        test_acc = accuracy(model.module, test_loader, device)
        if rank == 0:
            print(f"Epoch {epoch:02d} | loss {(s[0] / s[1]).item():.4f} | "
                  f"valid {valid_acc:.4f} | test {test_acc:.4f} | "
                  f"{time.time() - start:.1f}s", flush=True)
            if valid_acc > best_valid:
                best_valid, test_at_best = valid_acc, test_acc
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
        dist.barrier()

    if rank == 0:
        print(f"best valid {best_valid:.4f}, test at best valid {test_at_best:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
