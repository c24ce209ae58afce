#!/usr/bin/env python
"""GraphSAGE link prediction on the item co-purchase graph (Hits@K, AUC).

Every rank applies the same seeded RandomLinkSplit, trains on its own slice of the
supervision edges with LinkNeighborLoader and the val/test scores are gathered on rank 0.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29400 \
        train_sage_copurchase.py --data /mnt/graphs/copurchase/2024-05/data.pt
"""
import argparse
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.loader import LinkNeighborLoader
from torch_geometric.nn import SAGEConv
from torch_geometric.sampler import NegativeSampling
from torch_geometric.transforms import RandomLinkSplit


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="/mnt/experiments/sage_copurchase")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--fanout", type=str, default="15,10")
    ap.add_argument("--batch-size", type=int, default=1024, help="supervision edges per GPU (lr tuned for 2x8 GPUs)")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--dropout", type=float, default=0.3)
    ap.add_argument("--eval-neg-ratio", type=float, default=5.0)
    ap.add_argument("--hits-k", type=int, default=50)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--split-seed", type=int, default=1234)
    return ap.parse_args()


class SAGELinkPred(nn.Module):
    def __init__(self, in_dim, hidden, layers, dropout):
        super().__init__()
        self.convs = nn.ModuleList()
        self.norms = nn.ModuleList()
        dims = [in_dim] + [hidden] * layers
        for i in range(layers):
            self.convs.append(SAGEConv(dims[i], dims[i + 1]))
            self.norms.append(nn.BatchNorm1d(dims[i + 1]))
        self.dropout = dropout
        self.scorer = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x, edge_index, edge_label_index):
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            if i < len(self.convs) - 1:
                x = self.norms[i](x).relu()
                x = F.dropout(x, p=self.dropout, training=self.training)
            else:
                x = self.norms[i](x)
        src, dst = edge_label_index
        return self.scorer(x[src] * x[dst]).view(-1)


def gather_varlen(t, world_size):
    """all_gather for 1-D tensors whose length differs between ranks."""
    n = torch.tensor([t.numel()], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world_size)]
    dist.all_gather(sizes, n)
    max_n = int(max(s.item() for s in sizes))
    padded = torch.zeros(max_n, dtype=t.dtype, device=t.device)
    padded[: t.numel()] = t
    out = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(out, padded)
    return torch.cat([o[: int(s.item())] for o, s in zip(out, sizes)])


@torch.no_grad()
def score_split(model, split_data, fanout, args, rank, world_size, device):
    """Scores this rank's slice of the split's labelled edges, then gathers everything."""
    net = model.module
    net.eval()
    eli = split_data.edge_label_index.tensor_split(world_size, dim=1)[rank]
    lbl = split_data.edge_label.tensor_split(world_size)[rank]
    loader = LinkNeighborLoader(split_data, num_neighbors=fanout, edge_label_index=eli, edge_label=lbl,
                                batch_size=4 * args.batch_size, shuffle=False, num_workers=args.workers)
    scores, labels = [], []
    for batch in loader:
        batch = batch.to(device, non_blocking=True)
        scores.append(net(batch.x, batch.edge_index, batch.edge_label_index).sigmoid())
        labels.append(batch.edge_label)
    net.train()
    scores = torch.cat(scores) if scores else torch.empty(0, device=device)
    labels = torch.cat(labels).float() if labels else torch.empty(0, device=device)
    return gather_varlen(scores, world_size), gather_varlen(labels, world_size)


def hits_at_k(pos, neg, k):
    if neg.numel() < k:
        return 1.0
    kth = neg.topk(k).values[-1]
    return (pos > kth).float().mean().item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    fanout = [int(f) for f in args.fanout.split(",")]

    data = torch.load(args.data)
    # Same generator state on every rank -> identical split everywhere
    # (negative_sampling draws from python's `random`, so seed that too).
    random.seed(args.split_seed)
    torch.manual_seed(args.split_seed)
    split = RandomLinkSplit(num_val=0.05, num_test=0.10, is_undirected=True,
                            add_negative_train_samples=False,
                            neg_sampling_ratio=args.eval_neg_ratio)
    train_data, val_data, test_data = split(data)

    # Equal-sized training slices, so all ranks run the same number of steps.
    g = torch.Generator().manual_seed(args.split_seed)
    n_sup = train_data.edge_label_index.size(1)
    per_rank = n_sup // world_size
    perm = torch.randperm(n_sup, generator=g)[rank * per_rank:(rank + 1) * per_rank]
    train_loader = LinkNeighborLoader(
        train_data, num_neighbors=fanout,
        edge_label_index=train_data.edge_label_index[:, perm],
        edge_label=train_data.edge_label[perm],
        neg_sampling=NegativeSampling("binary", amount=1.0),
        batch_size=args.batch_size, shuffle=True, drop_last=True,
        num_workers=args.workers, persistent_workers=True,
    )
    torch.manual_seed(args.split_seed + rank)  # sampling / dropout streams differ per rank

    model = SAGELinkPred(data.num_features, args.hidden, args.layers, args.dropout)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world={world_size} train sup/rank={per_rank} val={val_data.edge_label.numel()} "
              f"test={test_data.edge_label.numel()}", flush=True)

    best_hits = -1.0
    for epoch in range(1, args.epochs + 1):
        model.train()
        t0 = time.time()
        stats = torch.zeros(2, device=device)
        for batch in train_loader:
            batch = batch.to(device, non_blocking=True)
            out = model(batch.x, batch.edge_index, batch.edge_label_index)
            loss = F.binary_cross_entropy_with_logits(out, batch.edge_label.float())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            stats[0] += loss.detach() * out.numel()
            stats[1] += out.numel()
        sched.step()
        dist.all_reduce(stats)

        scores, labels = score_split(model, val_data, fanout, args, rank, world_size, device)
        if rank == 0:
            pos, neg = scores[labels == 1], scores[labels == 0]
            hits = hits_at_k(pos, neg, args.hits_k)
            auc = roc_auc_score(labels.cpu().numpy(), scores.cpu().numpy())
            print(f"epoch {epoch:02d} loss {(stats[0] / stats[1]).item():.4f} "
                  f"val hits@{args.hits_k} {hits:.4f} auc {auc:.4f} {time.time() - t0:.0f}s", flush=True)
            if hits > best_hits:
                best_hits = hits
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))

    dist.barrier()
    state = torch.load(os.path.join(args.out, "best.pt"), map_location=device)
    model.module.load_state_dict(state)
    scores, labels = score_split(model, test_data, fanout, args, rank, world_size, device)
    if rank == 0:
        pos, neg = scores[labels == 1], scores[labels == 0]
        print(f"test hits@{args.hits_k} {hits_at_k(pos, neg, args.hits_k):.4f} "
              f"auc {roc_auc_score(labels.cpu().numpy(), scores.cpu().numpy()):.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
