"""Neural matrix factorisation on MovieLens-1M, one process per GPU started
with torch.multiprocessing.spawn (no torchrun on this box).

Gradients are averaged with all_reduce on the NCCL group; a second, gloo
group carries the small CPU-side bookkeeping (per-rank timings).

    python 16_spawn_movielens_mf.py --ratings ml-1m/ratings.dat --gpus 4
"""
import argparse
import os
import socket
import time
from datetime import timedelta

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ratings", required=True)
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--hidden", default="256,128,64")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--out", default="runs/neumf")
    ap.add_argument("--port", type=int, default=0)
    return ap.parse_args()


def load_ratings(path, seed=0):
    df = pd.read_csv(path, sep="::", engine="python", names=["user", "item", "rating", "ts"])
    users = {u: i for i, u in enumerate(sorted(df.user.unique()))}
    items = {m: i for i, m in enumerate(sorted(df.item.unique()))}
    u = df.user.map(users).to_numpy(np.int64)
    m = df.item.map(items).to_numpy(np.int64)
    r = df.rating.to_numpy(np.float32)
    perm = np.random.default_rng(seed).permutation(len(df))  # fixed seed: same split in every process
    n_test = len(df) // 10
    test, train = perm[:n_test], perm[n_test:]
    mk = lambda ix: TensorDataset(torch.from_numpy(u[ix]), torch.from_numpy(m[ix]), torch.from_numpy(r[ix]))
    return mk(train), mk(test), len(users), len(items)


class NeuMF(nn.Module):
    def __init__(self, n_users, n_items, dim, hidden):
        super().__init__()
        self.u_gmf, self.i_gmf = nn.Embedding(n_users, dim), nn.Embedding(n_items, dim)
        self.u_mlp, self.i_mlp = nn.Embedding(n_users, dim), nn.Embedding(n_items, dim)
        layers, prev = [], 2 * dim
        for h in hidden:
            layers += [nn.Linear(prev, h), nn.ReLU(), nn.Dropout(0.1)]
            prev = h
        self.mlp = nn.Sequential(*layers)
        self.out = nn.Linear(dim + prev, 1)
        for e in (self.u_gmf, self.i_gmf, self.u_mlp, self.i_mlp):
            nn.init.normal_(e.weight, std=0.01)

    def forward(self, u, i):
        gmf = self.u_gmf(u) * self.i_gmf(i)
        mlp = self.mlp(torch.cat([self.u_mlp(u), self.i_mlp(i)], dim=1))
        return self.out(torch.cat([gmf, mlp], dim=1)).squeeze(1) + 3.5


def worker(rank, world_size, args, port):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(minutes=10))
    cpu_group = dist.new_group(backend="gloo")  # every rank creates it
    device = torch.device("cuda", rank)
    torch.manual_seed(0)

    train_ds, test_ds, n_users, n_items = load_ratings(args.ratings)
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=0)
    # the test split is small: every rank scores a strided slice, sums are reduced below
    test_sub = torch.utils.data.Subset(test_ds, range(rank, len(test_ds), world_size))
    test_dl = DataLoader(test_sub, batch_size=8192)

    model = NeuMF(n_users, n_items, args.dim, [int(h) for h in args.hidden.split(",")]).to(device)
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{n_users} users, {n_items} items, {len(train_ds)} train ratings, {world_size} GPUs", flush=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for u, i, r in train_dl:
            u, i, r = u.to(device), i.to(device), r.to(device)
            loss = F.mse_loss(model(u, i), r)
            opt.zero_grad()
            loss.backward()
            grads = [p.grad for p in model.parameters()]
            flat = torch.cat([g.view(-1) for g in grads])
            dist.all_reduce(flat)
            flat.div_(world_size)
            off = 0
            for g in grads:
                g.copy_(flat[off:off + g.numel()].view_as(g))
                off += g.numel()
            opt.step()
        train_time = time.time() - t0

        model.eval()
        se = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for u, i, r in test_dl:
                u, i, r = u.to(device), i.to(device), r.to(device)
                se[0] += ((model(u, i).clamp(1, 5) - r) ** 2).sum()
                se[1] += r.numel()
        # per-rank partial sums to rank 0, summed there
        parts = [torch.zeros_like(se) for _ in range(world_size)] if rank == 0 else None
        dist.gather(se, gather_list=parts, dst=0)

        times = [None] * world_size
        dist.all_gather_object(times, {"rank": rank, "train_s": round(train_time, 2)}, group=cpu_group)

        if rank == 0:
            tot = torch.stack(parts).sum(0)
            rmse = (tot[0] / tot[1]).sqrt().item()
            slowest = max(times, key=lambda t: t["train_s"])
            print(f"epoch {epoch}: test RMSE {rmse:.4f}  slowest rank {slowest['rank']} "
                  f"{slowest['train_s']}s", flush=True)
            torch.save({"model": model.state_dict(), "epoch": epoch, "rmse": rmse,
                        "n_users": n_users, "n_items": n_items}, os.path.join(args.out, "neumf.pt"))
        dist.barrier()

    dist.destroy_process_group()


def find_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


if __name__ == "__main__":
    args = parse_args()
    port = args.port or find_port()
    mp.spawn(worker, args=(args.gpus, args, port), nprocs=args.gpus, join=True)
