"""Neural collaborative filtering (NeuMF) on MovieLens-20M implicit feedback.

Ported from the TF2 MirroredStrategy implementation (official/recommendation/ncf).
Leave-one-out evaluation: HR@10 / NDCG@10 over 1 positive + 99 sampled negatives.

    torchrun --nproc_per_node=8 13_ncf_recsys_ddp.py --ratings data/ml-20m/ratings.parquet
"""
import argparse
import math
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--ratings", default="data/ml-20m/ratings.parquet")
    p.add_argument("--factors", type=int, default=64)
    p.add_argument("--mlp", default="256,128,64")
    p.add_argument("--num-neg", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16384, help="per replica")
    p.add_argument("--lr", type=float, default=4.5e-3)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--target-hr", type=float, default=0.635)
    p.add_argument("--out", default="runs/ncf")
    return p.parse_args()


def load_interactions(path):
    df = pd.read_parquet(path, columns=["userId", "movieId", "timestamp"])
    df["user"] = df["userId"].astype("category").cat.codes.astype(np.int64)
    df["item"] = df["movieId"].astype("category").cat.codes.astype(np.int64)
    df = df.sort_values(["user", "timestamp"], kind="stable")
    last = df.groupby("user").tail(1)
    train = df.drop(last.index)
    return train[["user", "item"]].to_numpy(), last[["user", "item"]].to_numpy(), df.user.max() + 1, df.item.max() + 1


class NegSampledDataset(Dataset):
    """Each positive is followed by num_neg uniformly sampled items (label 0)."""

    def __init__(self, pairs, n_items, num_neg, seen):
        self.pairs, self.n_items, self.num_neg, self.seen = pairs, n_items, num_neg, seen

    def __len__(self):
        return len(self.pairs) * (1 + self.num_neg)

    def __getitem__(self, idx):
        u, i = self.pairs[idx // (1 + self.num_neg)]
        if idx % (1 + self.num_neg) == 0:
            return u, i, 1.0
        j = np.random.randint(self.n_items)
        while j in self.seen[u]:
            j = np.random.randint(self.n_items)
        return u, j, 0.0


class NeuMF(nn.Module):
    def __init__(self, n_users, n_items, factors, mlp_layers):
        super().__init__()
        self.gmf_user = nn.Embedding(n_users, factors)
        self.gmf_item = nn.Embedding(n_items, factors)
        self.mlp_user = nn.Embedding(n_users, mlp_layers[0] // 2)
        self.mlp_item = nn.Embedding(n_items, mlp_layers[0] // 2)
        layers = []
        for a, b in zip(mlp_layers[:-1], mlp_layers[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.mlp = nn.Sequential(*layers)
        self.out = nn.Linear(factors + mlp_layers[-1], 1)
        for emb in (self.gmf_user, self.gmf_item, self.mlp_user, self.mlp_item):
            nn.init.normal_(emb.weight, std=0.01)

    def forward(self, u, i):
        gmf = self.gmf_user(u) * self.gmf_item(i)
        mlp = self.mlp(torch.cat([self.mlp_user(u), self.mlp_item(i)], dim=-1))
        return self.out(torch.cat([gmf, mlp], dim=-1)).squeeze(-1)


def build_eval_candidates(holdout, n_items, seen, num=99, seed=0):
    rng = np.random.RandomState(seed)
    users, items = [], []
    for u, pos in holdout:
        negs = []
        while len(negs) < num:
            j = rng.randint(n_items)
            if j not in seen[u] and j != pos:
                negs.append(j)
        users.append(np.full(num + 1, u))
        items.append(np.array([pos] + negs))
    return torch.from_numpy(np.stack(users)), torch.from_numpy(np.stack(items))


@torch.no_grad()
def hit_rate_ndcg(net, users, items, device, k=10, chunk=4096):
    net.eval()
    hits, ndcg = 0.0, 0.0
    for s in range(0, users.size(0), chunk):
        u, it = users[s:s + chunk].to(device), items[s:s + chunk].to(device)
        scores = net(u.reshape(-1), it.reshape(-1)).view(u.shape)
        rank = (scores > scores[:, :1]).sum(1)  # position of the positive (column 0)
        hit = rank < k
        hits += hit.sum().item()
        ndcg += (hit.float() / torch.log2(rank.float() + 2)).sum().item()
    net.train()
    return hits / users.size(0), ndcg / users.size(0)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    np.random.seed(rank)

    train_pairs, holdout, n_users, n_items = load_interactions(args.ratings)
    seen = [set() for _ in range(n_users)]
    for u, i in train_pairs:
        seen[u].add(i)
    for u, i in holdout:
        seen[u].add(i)
    train_ds = NegSampledDataset(train_pairs, n_items, args.num_neg, seen)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=8,
                              pin_memory=True, drop_last=True, persistent_workers=True,
                              worker_init_fn=lambda w: np.random.seed(1000 * rank + w))

    mlp_layers = [int(x) for x in args.mlp.split(",")]
    net = NeuMF(n_users, n_items, args.factors, mlp_layers).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * math.sqrt(world), betas=(0.25, 0.5))
    loss_fn = nn.BCEWithLogitsLoss()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        eval_users, eval_items = build_eval_candidates(holdout, n_items, seen)
        print(f"users={n_users} items={n_items} train_pairs={len(train_pairs)} replicas={world} "
              f"steps/epoch={len(train_loader)}", flush=True)

    best_hr = 0.0
    for epoch in range(args.epochs):
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for u, i, y in train_loader:
            u, i = u.to(device, non_blocking=True), i.to(device, non_blocking=True)
            y = y.float().to(device, non_blocking=True)
            loss = loss_fn(model(u, i), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(running)

        stop = torch.zeros(1, device=device)
        if rank == 0:
            hr, ndcg = hit_rate_ndcg(net, eval_users, eval_items, device)
            print(f"epoch {epoch + 1}: loss={(running[0] / running[1]).item():.4f} HR@10={hr:.4f} "
                  f"NDCG@10={ndcg:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if hr > best_hr:
                best_hr = hr
                torch.save(net.state_dict(), os.path.join(args.out, "neumf_best.pt"))
            if hr >= args.target_hr:
                stop.fill_(1.0)
        dist.broadcast(stop, 0)
        if stop.item():
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
