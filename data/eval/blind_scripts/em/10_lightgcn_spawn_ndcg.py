#!/usr/bin/env python
"""LightGCN for the "complete the look" graph, one process per visible GPU via mp.spawn.

Single-node tool used from the team's Airflow GPU box, where torchrun is not available:

    CUDA_VISIBLE_DEVICES=0,1,2,3 python lightgcn_ctl.py --graph /mnt/graphs/ctl/graph.pt --accum 2
"""
import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.nn import LightGCN


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_graph(path):
    g = torch.load(path, map_location="cpu")
    nu, ni = g["num_users"], g["num_items"]
    tr = g["train"]
    msg = torch.stack([torch.cat([tr[0], tr[1] + nu]), torch.cat([tr[1] + nu, tr[0]])])
    return nu, ni, tr, g["test"], msg


@torch.no_grad()
def evaluate(model, msg, train, test, nu, ni, k, rank, world, device):
    emb = model.module.get_embedding(msg)
    ue, ie = emb[:nu], emb[nu:]
    users = torch.unique(test[0])
    # contiguous, non-overlapping blocks of users; no padding, so nothing is counted twice
    bounds = torch.linspace(0, users.numel(), world + 1).long()
    users = users[bounds[rank]:bounds[rank + 1]]
    disc = 1.0 / torch.log2(torch.arange(k, device=device) + 2.0)
    totals = torch.zeros(3, device=device)
    for block in users.split(2048):
        slot = torch.full((nu,), -1, dtype=torch.long, device=device)
        slot[block] = torch.arange(block.numel(), device=device)
        s = ue[block] @ ie.t()
        r = slot[train[0]]
        s[r[r >= 0], train[1][r >= 0]] = float("-inf")
        truth = torch.zeros_like(s, dtype=torch.bool)
        r = slot[test[0]]
        truth[r[r >= 0], test[1][r >= 0]] = True
        rel = truth.gather(1, s.topk(k, dim=1).indices).float()
        n_rel = truth.sum(1).clamp(max=k)
        idcg = disc.cumsum(0)[n_rel - 1]
        totals[0] += ((rel * disc).sum(1) / idcg).sum()
        totals[1] += (rel.sum(1) / n_rel).sum()
        totals[2] += block.numel()
    # only rank 0 reports, but every rank takes part in the reduce
    dist.reduce(totals, dst=0)
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)

    nu, ni, train, test, msg = load_graph(args.graph)
    train, test, msg = train.to(device), test.to(device), msg.to(device)

    torch.manual_seed(args.seed)
    model = DDP(LightGCN(nu + ni, args.dim, args.layers).to(device), device_ids=[rank])
    # global batch = world_size * batch * accum; lr is tuned for that
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    idx = range(train.size(1))
    sampler = DistributedSampler(idx, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(idx, batch_size=args.batch, sampler=sampler, drop_last=True)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{world_size} procs | users {nu} items {ni} | {len(loader)} steps/epoch", flush=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=device)
        opt.zero_grad(set_to_none=True)
        for step, batch_idx in enumerate(loader):
            batch_idx = batch_idx.to(device)
            u, i = train[:, batch_idx]
            j = torch.randint(0, ni, u.shape, device=device)
            eli = torch.stack([torch.cat([u, u]), torch.cat([i, j]) + nu])
            sync_now = (step + 1) % args.accum == 0
            if sync_now:
                pos_rank, neg_rank = model(msg, eli).chunk(2)
                loss = model.module.recommendation_loss(pos_rank, neg_rank, node_id=eli.unique())
                (loss / args.accum).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            else:
                with model.no_sync():
                    pos_rank, neg_rank = model(msg, eli).chunk(2)
                    loss = model.module.recommendation_loss(pos_rank, neg_rank, node_id=eli.unique())
                    (loss / args.accum).backward()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(run)

        ndcg, recall = evaluate(model, msg, train, test, nu, ni, args.k, rank, world_size, device)
        if rank == 0:
            print(f"epoch {epoch:02d} loss {(run[0] / run[1]).item():.4f} ndcg@{args.k} {ndcg:.4f} "
                  f"recall@{args.k} {recall:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if ndcg > best:
                best = ndcg
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))

    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--graph", required=True)
    ap.add_argument("--out", default="/mnt/experiments/lightgcn_ctl")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()

    world_size = torch.cuda.device_count()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(worker, args=(world_size, args), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
