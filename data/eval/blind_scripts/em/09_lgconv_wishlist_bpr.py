"""
Wishlist recommender: LightGCN built from LGConv layers, BPR loss, NDCG@K / HR@K.

The graph file is produced by the nightly ETL (etl/wishlist_graph.py):
    edge_index_train [2, E]  (user, item), edge_index_test [2, E_test], num_users, num_items

    torchrun --nproc_per_node=8 lgconv_wishlist.py --dim 128
"""
import argparse
import os
import time
from datetime import datetime

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.nn import LGConv
from torch_geometric.utils import degree

GRAPH = "/mnt/graphs/wishlist/current/graph.pt"
OUT = "/mnt/experiments/wishlist_lightgcn"


class Interactions(Dataset):
    """One sample per (user, item) training pair; negatives are drawn on the GPU."""

    def __init__(self, edge_index):
        self.users = edge_index[0]
        self.items = edge_index[1]

    def __len__(self):
        return self.users.numel()

    def __getitem__(self, i):
        return self.users[i], self.items[i]


class LightGCNModel(nn.Module):
    def __init__(self, num_users, num_items, dim, num_layers):
        super().__init__()
        self.num_users, self.num_items = num_users, num_items
        self.emb = nn.Embedding(num_users + num_items, dim)
        nn.init.normal_(self.emb.weight, std=0.1)
        self.convs = nn.ModuleList([LGConv() for _ in range(num_layers)])
        self.alpha = 1.0 / (num_layers + 1)

    def propagate_all(self, edge_index):
        x = self.emb.weight
        out = x * self.alpha
        for conv in self.convs:
            x = conv(x, edge_index)
            out = out + x * self.alpha
        return out

    def forward(self, edge_index, users, pos, neg):
        out = self.propagate_all(edge_index)
        u = out[users]
        p = out[self.num_users + pos]
        n = out[self.num_users + neg]
        e0 = self.emb(torch.cat([users, self.num_users + pos, self.num_users + neg]))
        return (u * p).sum(-1), (u * n).sum(-1), e0.pow(2).sum() / (2 * users.numel())


@torch.no_grad()
def ndcg_hr(model, edge_index, train_ei, test_ei, k, rank, world, device):
    net = model.module
    out = net.propagate_all(edge_index)
    ue, ie = out[: net.num_users], out[net.num_users:]
    users = torch.unique(test_ei[0])
    users = users[rank::world]
    log_disc = 1.0 / torch.log2(torch.arange(2, k + 2, device=device).float())
    acc = torch.zeros(3, device=device)
    for chunk in users.split(1024):
        lut = torch.full((net.num_users,), -1, device=device, dtype=torch.long)
        lut[chunk] = torch.arange(len(chunk), device=device)
        score = ue[chunk] @ ie.T
        r = lut[train_ei[0]]
        keep = r >= 0
        score[r[keep], train_ei[1][keep]] = float("-inf")
        gt = torch.zeros_like(score, dtype=torch.bool)
        r = lut[test_ei[0]]
        keep = r >= 0
        gt[r[keep], test_ei[1][keep]] = True
        rel = gt.gather(1, score.topk(k, 1).indices).float()
        ideal = torch.cumsum(log_disc, 0)[gt.sum(1).clamp(1, k) - 1]
        acc[0] += ((rel * log_disc).sum(1) / ideal).sum()
        acc[1] += (rel.sum(1) > 0).float().sum()
        acc[2] += len(chunk)
    dist.all_reduce(acc)
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--graph", default=GRAPH)
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--batch", type=int, default=2048, help="pairs per GPU")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--decay", type=float, default=1e-4)
    ap.add_argument("--topk", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=5)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    g = torch.load(args.graph)
    nu, ni = g["num_users"], g["num_items"]
    train_ei, test_ei = g["edge_index_train"], g["edge_index_test"]
    ui = torch.stack([train_ei[0], train_ei[1] + nu])
    edge_index = torch.cat([ui, ui.flip(0)], dim=1).to(device)
    if rank == 0:
        deg = degree(train_ei[0], nu)
        print(f"{datetime.now():%H:%M:%S} users={nu} items={ni} pairs={train_ei.size(1)} "
              f"mean user degree={deg.mean():.1f}", flush=True)

    ds = Interactions(train_ei)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True)
    loader = DataLoader(ds, batch_size=args.batch, sampler=sampler, num_workers=2, pin_memory=True,
                        drop_last=True)

    torch.manual_seed(1)
    model = LightGCNModel(nu, ni, args.dim, args.layers).to(device)
    model = DDP(model, device_ids=[local_rank])
    # lr tuned for 8 GPUs x 2048 pairs
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    train_dev, test_dev = train_ei.to(device), test_ei.to(device)
    os.makedirs(args.out, exist_ok=True)
    best_ndcg = 0.0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for users, pos in loader:
            users = users.to(device, non_blocking=True)
            pos = pos.to(device, non_blocking=True)
            neg = torch.randint(0, ni, pos.shape, device=device)
            ps, ns, reg = model(edge_index, users, pos, neg)
            loss = F.softplus(ns - ps).mean() + args.decay * reg
            opt.zero_grad()
            loss.backward()
            opt.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(acc)

        msg = f"epoch {epoch:3d} loss {(acc[0] / acc[1]).item():.5f} {time.time() - t0:.0f}s"
        if (epoch + 1) % args.eval_every == 0:
            model.eval()
            ndcg, hr = ndcg_hr(model, edge_index, train_dev, test_dev, args.topk, rank, world, device)
            msg += f" ndcg@{args.topk} {ndcg:.4f} hr@{args.topk} {hr:.4f}"
            if rank == 0 and ndcg > best_ndcg:
                best_ndcg = ndcg
                torch.save({"state_dict": model.module.state_dict(), "epoch": epoch,
                            "num_users": nu, "num_items": ni}, os.path.join(args.out, "best.pt"))
        if rank == 0:
            print(msg, flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
