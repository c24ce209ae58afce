#!/usr/bin/env python
"""Link prediction on ogbl-citation2 with GraphSAGE + LinkNeighborLoader, DDP.

Each epoch every rank takes an equal random slice of the training edges and draws
fresh random negatives (binary cross-entropy objective). Validation follows the
OGB protocol: each source node ranks its true target against 1000 given negative
targets and MRR is averaged over all sources.

    torchrun --nproc_per_node=4 15_pyg_linkpred_citation2.py --epochs 20 --eval-sources 20000
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch_geometric.transforms as T
from ogb.linkproppred import PygLinkPropPredDataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.loader import LinkNeighborLoader, NeighborLoader
from torch_geometric.nn import SAGEConv


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="data/ogb")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--fanout", type=int, nargs="+", default=[15, 10, 5])
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--edges-per-epoch", type=int, default=4_000_000)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--eval-sources", type=int, default=20000)
    p.add_argument("--out", default="ckpt/citation2")
    return p.parse_args()


class Encoder(nn.Module):
    def __init__(self, in_dim, hidden, layers):
        super().__init__()
        self.convs = nn.ModuleList(
            [SAGEConv(in_dim if i == 0 else hidden, hidden) for i in range(layers)])

    def forward(self, x, edge_index):
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            if i < len(self.convs) - 1:
                x = F.dropout(F.relu(x), 0.2, self.training)
        return x


class LinkPredictor(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, h_src, h_dst):
        return self.mlp(h_src * h_dst).squeeze(-1)


class Net(nn.Module):
    def __init__(self, in_dim, hidden, layers):
        super().__init__()
        self.enc = Encoder(in_dim, hidden, layers)
        self.pred = LinkPredictor(hidden)

    def forward(self, x, edge_index, edge_label_index):
        h = self.enc(x, edge_index)
        return self.pred(h[edge_label_index[0]], h[edge_label_index[1]])


@torch.no_grad()
def evaluate_mrr(net, data, split, fanout, device, rank, world, max_sources):
    """OGB-style MRR on this rank's share of the validation sources."""
    net.eval()
    src = split["source_node"][:max_sources]
    dst = split["target_node"][:max_sources]
    neg = split["target_node_neg"][:max_sources]
    mine = torch.arange(rank, src.numel(), world)
    src, dst, neg = src[mine], dst[mine], neg[mine]
    rr_sum, count = 0.0, 0
    for chunk in torch.arange(src.numel()).split(256):
        s, d, n = src[chunk], dst[chunk], neg[chunk]
        nodes = torch.cat([s, d, n.flatten()]).unique()
        loader = NeighborLoader(data, input_nodes=nodes, num_neighbors=fanout,
                                batch_size=nodes.numel(), shuffle=False)
        batch = next(iter(loader)).to(device)
        h = net.enc(batch.x, batch.edge_index)[: batch.batch_size]
        pos_map = torch.full((data.num_nodes,), -1, dtype=torch.long)
        pos_map[batch.n_id[: batch.batch_size].cpu()] = torch.arange(batch.batch_size)
        hs = h[pos_map[s].to(device)]
        pos = net.pred(hs, h[pos_map[d].to(device)])
        negs = net.pred(hs.unsqueeze(1).expand(-1, n.size(1), -1),
                        h[pos_map[n].to(device)])
        rank_ = (negs >= pos.unsqueeze(1)).sum(1) + 1
        rr_sum += (1.0 / rank_.float()).sum().item()
        count += s.numel()
    stats = torch.tensor([rr_sum, float(count)], dtype=torch.float64)
    dist.all_reduce(stats)
    net.train()
    return (stats[0] / stats[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    dataset = PygLinkPropPredDataset("ogbl-citation2", root=args.root)
    data = dataset[0]
    split_edge = dataset.get_edge_split()
    data.edge_index = T.ToUndirected()(data).edge_index
    data.x = data.x.float()
    train_pos = torch.stack([split_edge["train"]["source_node"],
                             split_edge["train"]["target_node"]])

    net = Net(data.num_features, args.hidden, args.layers).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    per_rank = args.edges_per_epoch // world
    best = 0.0
    for epoch in range(args.epochs):
        g = torch.Generator().manual_seed(1000 + epoch)
        perm = torch.randperm(train_pos.size(1), generator=g)[: per_rank * world]
        my_edges = train_pos[:, perm[rank * per_rank:(rank + 1) * per_rank]]
        # fresh negatives every epoch, different on each rank
        torch.manual_seed(1000 * epoch + rank)
        loader = LinkNeighborLoader(
            data, num_neighbors=args.fanout, edge_label_index=my_edges,
            neg_sampling="binary", batch_size=args.batch_size, shuffle=True,
            drop_last=True, num_workers=6)
        t0 = time.time()
        loss_sum, steps = 0.0, 0
        for batch in loader:
            batch = batch.to(device, non_blocking=True)
            logits = model(batch.x, batch.edge_index, batch.edge_label_index)
            loss = F.binary_cross_entropy_with_logits(logits, batch.edge_label.float())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum += loss.item()
            steps += 1

        mrr = evaluate_mrr(net, data, split_edge["valid"], args.fanout, device, rank, world,
                           args.eval_sources)
        if rank == 0:
            print(f"epoch {epoch:02d} loss {loss_sum / steps:.4f} valid MRR {mrr:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if mrr > best:
                best = mrr
                torch.save(net.state_dict(), os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
