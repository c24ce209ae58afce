#!/usr/bin/env python
"""Complementary-item retrieval ("goes well with"): GraphSAGE trained with triplet
negatives from LinkNeighborLoader, margin / BPR loss, Recall@K against all items.

    torchrun --nproc_per_node=8 sage_complement.py --data /mnt/graphs/complement/v2 --decoder dot
"""
import argparse
import copy
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.loader import LinkNeighborLoader, NeighborLoader
from torch_geometric.nn import SAGEConv
from torch_geometric.sampler import NegativeSampling


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="dir with graph.pt (train message edges) and pairs.pt")
    p.add_argument("--out", default="/mnt/experiments/complement_sage")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--out-dim", type=int, default=128)
    p.add_argument("--decoder", choices=["dot", "mlp"], default="dot")
    p.add_argument("--fanout", type=int, nargs="+", default=[20, 10])
    p.add_argument("--batch-size", type=int, default=1024, help="per GPU; lr tuned for 8 GPUs")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--k", type=int, default=50)
    return p.parse_args()


class ComplementModel(nn.Module):
    def __init__(self, in_dim, hidden, out_dim, decoder="dot"):
        super().__init__()
        self.conv1 = SAGEConv(in_dim, hidden)
        self.conv2 = SAGEConv(hidden, out_dim)
        self.decoder = decoder
        # asymmetric relation: A -> B is not B -> A, the MLP decoder can learn that
        self.mlp = nn.Sequential(nn.Linear(2 * out_dim, out_dim), nn.ReLU(), nn.Linear(out_dim, 1))

    def embed(self, x, edge_index):
        h = self.conv1(x, edge_index).relu()
        h = F.dropout(h, 0.1, training=self.training)
        return self.conv2(h, edge_index)

    def score(self, hs, hd):
        if self.decoder == "mlp":
            return self.mlp(torch.cat([hs, hd], dim=-1)).squeeze(-1)
        return (hs * hd).sum(-1)

    def forward(self, x, edge_index, src, dst_pos, dst_neg):
        h = self.embed(x, edge_index)
        return self.score(h[src], h[dst_pos]), self.score(h[src], h[dst_neg])

    @torch.no_grad()
    def full_embed(self, x_all, loader, device):
        for li, conv in enumerate([self.conv1, self.conv2]):
            outs = []
            for b in loader:
                h = conv(x_all[b.n_id].to(device), b.edge_index.to(device))
                if li == 0:
                    h = h.relu()
                outs.append(h[: b.batch_size].cpu())
            x_all = torch.cat(outs)
        return x_all


@torch.no_grad()
def recall_eval(model, data, pairs, k, workers, rank, world, device):
    """Recall@k of the true complement among all items (dot decoder only at retrieval)."""
    net = model.module
    net.eval()
    sub = copy.copy(data)
    sub.x = None
    loader = NeighborLoader(sub, num_neighbors=[-1], batch_size=8192, num_workers=workers)
    h = net.full_embed(data.x, loader, device).to(device)
    src, dst = pairs[0][rank::world].to(device), pairs[1][rank::world].to(device)
    acc = torch.zeros(2, device=device)
    for s, d in zip(src.split(2048), dst.split(2048)):
        scores = h[s] @ h.t()
        scores[torch.arange(s.numel(), device=device), s] = float("-inf")  # not itself
        top = scores.topk(k, dim=1).indices
        acc[0] += (top == d.unsqueeze(1)).any(1).sum()
        acc[1] += s.numel()
    dist.all_reduce(acc)
    net.train()
    return (acc[0] / acc[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    data = torch.load(os.path.join(args.data, "graph.pt"))
    pairs = torch.load(os.path.join(args.data, "pairs.pt"))   # {"train": [2, E], "val": [2, V], "test": [2, T]}
    train_pairs = pairs["train"]
    n = train_pairs.size(1) // world
    order = torch.randperm(train_pairs.size(1), generator=torch.Generator().manual_seed(7))
    mine = order[rank * n:(rank + 1) * n]

    loader = LinkNeighborLoader(
        data,
        num_neighbors=args.fanout,
        edge_label_index=train_pairs[:, mine],
        neg_sampling=NegativeSampling("triplet", amount=1),
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=args.workers,
        persistent_workers=True,
    )

    torch.manual_seed(0)
    model = ComplementModel(data.num_features, args.hidden, args.out_dim, args.decoder).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{world} ranks x {len(loader)} steps, decoder={args.decoder}", flush=True)

    best = 0.0
    for epoch in range(args.epochs):
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for b in loader:
            b = b.to(device, non_blocking=True)
            pos, neg = model(b.x, b.edge_index, b.src_index, b.dst_pos_index, b.dst_neg_index.view(-1))
            loss = F.softplus(neg - pos).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)

        recall = recall_eval(model, data, pairs["val"], args.k, args.workers, rank, world, device)
        if rank == 0:
            print(f"epoch {epoch} loss {(tot[0] / tot[1]).item():.4f} val recall@{args.k} {recall:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if recall > best:
                best = recall
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))

    dist.barrier()
    model.module.load_state_dict(torch.load(os.path.join(args.out, "best.pt"), map_location=device))
    recall = recall_eval(model, data, pairs["test"], args.k, args.workers, rank, world, device)
    if rank == 0:
        print(f"test recall@{args.k} {recall:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
