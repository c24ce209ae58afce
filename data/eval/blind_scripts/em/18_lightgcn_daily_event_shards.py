"""
LightGCN fine-tuning on the most recent click days.

The propagation graph (all purchases, 180 days) is fixed and loaded by every rank.
Training pairs come from the daily click exports (one parquet per day); the days are
spread over the ranks so that each GPU reads only its own files.

    torchrun --nproc_per_node=8 lgcn_daily.py \
        --graph /mnt/graphs/purchase_180d/graph.pt \
        --clicks "/mnt/lake/clicks_daily/dt=2024-06-*/part.parquet" \
        --init /mnt/experiments/lgcn_purchase/best.pt
"""
import argparse
import glob
import os
import time

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch_geometric.nn import LightGCN


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--graph", required=True)
    ap.add_argument("--clicks", required=True, help="glob of daily parquet files")
    ap.add_argument("--init", default=None, help="state_dict of a pretrained LightGCN")
    ap.add_argument("--out", default="/mnt/experiments/lgcn_daily")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=8192, help="per GPU")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--k", type=int, default=20)
    return ap.parse_args()


def read_pairs(files, num_users, num_items):
    us, its = [], []
    for f in files:
        t = pq.read_table(f, columns=["user_idx", "item_idx"])
        u = t.column("user_idx").to_numpy()
        i = t.column("item_idx").to_numpy()
        ok = (u < num_users) & (i < num_items)  # ids unseen in the 180-day graph are dropped
        us.append(u[ok])
        its.append(i[ok])
    return torch.from_numpy(np.concatenate(us)).long(), torch.from_numpy(np.concatenate(its)).long()


@torch.no_grad()
def hit_rate(model, edge_index, eval_pairs, nu, k, rank, world, device):
    """Leave-last-out style: fraction of held-out (user, item) pairs whose item is in the user's top-k."""
    emb = model.module.get_embedding(edge_index)
    ue, ie = emb[:nu], emb[nu:]
    u, i = eval_pairs[0][rank::world].to(device), eval_pairs[1][rank::world].to(device)
    hits = torch.zeros(2, device=device)
    for uc, ic in zip(u.split(4096), i.split(4096)):
        top = (ue[uc] @ ie.t()).topk(k, dim=1).indices
        hits[0] += (top == ic.unsqueeze(1)).any(1).float().sum()
        hits[1] += uc.numel()
    dist.all_reduce(hits)
    return (hits[0] / hits[1]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    g = torch.load(args.graph, map_location="cpu")
    nu, ni = g["num_users"], g["num_items"]
    ui = g["edge_index"]
    edge_index = torch.cat([torch.stack([ui[0], ui[1] + nu]), torch.stack([ui[1] + nu, ui[0]])], 1).to(device)

    files = sorted(glob.glob(args.clicks))
    eval_file, train_files = files[-1], files[:-1]
    my_files = train_files[rank::world]
    users, items = read_pairs(my_files, nu, ni)
    eval_pairs = read_pairs([eval_file], nu, ni)
    print(f"rank {rank}: {len(my_files)} days, {users.numel():,} pairs", flush=True)

    loader = DataLoader(TensorDataset(users, items), batch_size=args.batch_size, shuffle=True,
                        num_workers=2, pin_memory=True)

    model = LightGCN(nu + ni, args.dim, args.layers)
    if args.init:
        model.load_state_dict(torch.load(args.init, map_location="cpu"))
    model = DDP(model.to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    hr = hit_rate(model, edge_index, eval_pairs, nu, args.k, rank, world, device)
    if rank == 0:
        print(f"before fine-tuning: hr@{args.k} {hr:.4f}", flush=True)

    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for u, i in loader:
            u = u.to(device, non_blocking=True)
            i = i.to(device, non_blocking=True) + nu
            j = torch.randint(nu, nu + ni, u.shape, device=device)
            eli = torch.stack([torch.cat([u, u]), torch.cat([i, j])])
            pos_rank, neg_rank = model(edge_index, eli).chunk(2)
            loss = F.softplus(neg_rank - pos_rank).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)

        hr = hit_rate(model, edge_index, eval_pairs, nu, args.k, rank, world, device)
        if rank == 0:
            print(f"epoch {epoch} loss {(tot[0] / tot[1]).item():.4f} hr@{args.k} {hr:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            torch.save(model.module.state_dict(), os.path.join(args.out, f"epoch{epoch}.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
