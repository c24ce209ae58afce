"""Frequently-bought-together: GraphSAGE link prediction, citation2-style MRR evaluation.

val/test hold source_node, target_node and target_node_neg [E, 1000] (pre-sampled
negatives per positive), so the metric is comparable between runs.

Launch:
    torchrun --nnodes=1 --nproc_per_node=8 fbt_sage.py --root /mnt/graphs/fbt/2024-06
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
from tqdm import tqdm


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", default="/mnt/experiments/fbt_sage")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--fanout", type=int, nargs="+", default=[15, 10])
    p.add_argument("--batch-size", type=int, default=1024, help="per GPU (8-GPU lr)")
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--eval-max", type=int, default=100_000, help="cap on val positives per eval")
    return p.parse_args()


class SAGE(nn.Module):
    def __init__(self, in_dim, hidden, layers):
        super().__init__()
        self.convs = nn.ModuleList()
        for i in range(layers):
            self.convs.append(SAGEConv(in_dim if i == 0 else hidden, hidden))
        self.lin = nn.Linear(hidden, hidden)

    def embed(self, x, edge_index):
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            if i != len(self.convs) - 1:
                x = x.relu()
        return self.lin(x)

    def forward(self, x, edge_index, edge_label_index):
        h = self.embed(x, edge_index)
        return (h[edge_label_index[0]] * h[edge_label_index[1]]).sum(-1)

    @torch.no_grad()
    def inference(self, x_all, loader, device, verbose):
        for i, conv in enumerate(self.convs):
            xs = []
            for batch in tqdm(loader, desc=f"layer {i}", disable=not verbose):
                h = conv(x_all[batch.n_id].to(device), batch.edge_index.to(device))
                if i != len(self.convs) - 1:
                    h = h.relu()
                xs.append(h[: batch.batch_size].cpu())
            x_all = torch.cat(xs)
        return self.lin(x_all.to(device))


@torch.no_grad()
def mrr_eval(model, data, split, args, rank, world, device):
    net = model.module
    net.eval()
    sub = copy.copy(data)
    sub.x = None
    loader = NeighborLoader(sub, num_neighbors=[-1], batch_size=16384, num_workers=args.workers)
    h = net.inference(data.x, loader, device, verbose=rank == 0)

    src = split["source_node"][: args.eval_max]
    dst = split["target_node"][: args.eval_max]
    neg = split["target_node_neg"][: args.eval_max]
    src, dst, neg = src[rank::world], dst[rank::world], neg[rank::world]

    ranks = []
    for s, d, n in zip(src.split(2048), dst.split(2048), neg.split(2048)):
        s, d, n = s.to(device), d.to(device), n.to(device)
        pos_score = (h[s] * h[d]).sum(-1, keepdim=True)
        neg_score = (h[s].unsqueeze(1) * h[n]).sum(-1)
        ranks.append((1 + (neg_score >= pos_score).sum(-1)).cpu())
    ranks = torch.cat(ranks).double()

    stats = torch.tensor([(1.0 / ranks).sum().item(), (ranks <= 10).sum().item(),
                          (ranks <= 50).sum().item(), ranks.numel()], dtype=torch.float64)
    dist.all_reduce(stats)
    net.train()
    return {"mrr": (stats[0] / stats[3]).item(), "hits@10": (stats[1] / stats[3]).item(),
            "hits@50": (stats[2] / stats[3]).item()}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    data = torch.load(os.path.join(args.root, "graph.pt"))          # message-passing graph (train edges)
    split = torch.load(os.path.join(args.root, "split.pt"))         # {"train": ..., "valid": ..., "test": ...}
    train_pos = split["train"]["edge"].t()                          # [2, E]

    per_rank = train_pos.size(1) // world
    perm = torch.randperm(train_pos.size(1), generator=torch.Generator().manual_seed(0))
    mine = perm[rank * per_rank:(rank + 1) * per_rank]
    loader = LinkNeighborLoader(
        data, num_neighbors=args.fanout, edge_label_index=train_pos[:, mine],
        neg_sampling_ratio=1.0, batch_size=args.batch_size, shuffle=True, drop_last=True,
        num_workers=args.workers, persistent_workers=True,
    )

    torch.manual_seed(0)
    model = DDP(SAGE(data.num_features, args.hidden, args.layers).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for batch in tqdm(loader, desc=f"epoch {epoch}", disable=rank != 0):
            batch = batch.to(device)
            logits = model(batch.x, batch.edge_index, batch.edge_label_index)
            loss = F.binary_cross_entropy_with_logits(logits, batch.edge_label)
            opt.zero_grad()
            loss.backward()
            opt.step()
            tot[0] += loss.detach()
            tot[1] += 1
        dist.all_reduce(tot)

        res = mrr_eval(model, data, split["valid"], args, rank, world, device)
        if rank == 0:
            print(f"epoch {epoch} loss {(tot[0] / tot[1]).item():.4f} valid {res} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if res["mrr"] > best:
                best = res["mrr"]
                torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(args.out, "best.pt"))

    dist.barrier()
    ckpt = torch.load(os.path.join(args.out, "best.pt"), map_location=device)
    model.module.load_state_dict(ckpt["model"])
    res = mrr_eval(model, data, split["test"], args, rank, world, device)
    if rank == 0:
        print(f"test (epoch {ckpt['epoch']}): {res}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
