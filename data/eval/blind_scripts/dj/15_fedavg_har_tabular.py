"""Federated human-activity recognition (UCI HAR, 561 features) with FedAvg.

The pooled training set is split over the clients with a Dirichlet(alpha)
prior on the activity labels. Feature standardisation statistics are computed
federatedly (sums and squared sums are all-reduced, raw data never leaves a
client).

    torchrun --nproc_per_node=6 15_fedavg_har_tabular.py --har_dir /data/UCI_HAR_Dataset
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


def options():
    ap = argparse.ArgumentParser()
    ap.add_argument("--har_dir", default="/data/UCI_HAR_Dataset")
    ap.add_argument("--out", default="./results/har_fedavg")
    ap.add_argument("--rounds", type=int, default=80)
    ap.add_argument("--local_epochs", type=int, default=3)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--alpha", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=8)
    return ap.parse_args()


def read_split(har_dir, split):
    X = np.loadtxt(os.path.join(har_dir, split, f"X_{split}.txt"), dtype=np.float32)
    y = np.loadtxt(os.path.join(har_dir, split, f"y_{split}.txt"), dtype=np.int64) - 1
    return X, y


def dirichlet_partition(y, n_clients, alpha, rng):
    out = [[] for _ in range(n_clients)]
    for c in np.unique(y):
        ids = rng.permutation(np.flatnonzero(y == c))
        share = rng.dirichlet(np.repeat(alpha, n_clients))
        for k, chunk in enumerate(np.split(ids, (np.cumsum(share)[:-1] * len(ids)).astype(int))):
            out[k].extend(chunk.tolist())
    return [np.array(sorted(o), dtype=np.int64) for o in out]


class HARNet(nn.Module):
    def __init__(self, in_dim, hidden, n_classes):
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(in_dim, hidden), nn.LayerNorm(hidden), nn.GELU(), nn.Dropout(0.2),
            nn.Linear(hidden, hidden // 2), nn.LayerNorm(hidden // 2), nn.GELU(), nn.Dropout(0.2),
        )
        self.out = nn.Linear(hidden // 2, n_classes)

    def forward(self, x):
        return self.out(self.body(x))


@torch.no_grad()
def federated_standardizer(X_local, device):
    x = torch.from_numpy(X_local).to(device, torch.float64)
    s = torch.cat([x.sum(0), (x * x).sum(0), torch.tensor([float(len(x))], device=device,
                                                            dtype=torch.float64)])
    dist.all_reduce(s)
    d = X_local.shape[1]
    n = s[-1]
    mean = s[:d] / n
    var = s[d:2 * d] / n - mean ** 2
    return mean.float().cpu().numpy(), var.clamp_min(1e-8).sqrt().float().cpu().numpy()


def local_fit(model, loader, args, device):
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    tot = cnt = 0
    for _ in range(args.local_epochs):
        for xb, yb in loader:
            xb, yb = xb.to(device), yb.to(device)
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            tot += loss.item() * len(yb)
            cnt += len(yb)
    return tot / max(cnt, 1)


@torch.no_grad()
def weighted_average(model, n_local, device):
    n = torch.tensor(float(n_local), device=device)
    n_all = n.clone()
    dist.all_reduce(n_all)
    for p in model.parameters():
        p.mul_(n / n_all)
        dist.all_reduce(p)


@torch.no_grad()
def evaluate(model, X, y, device, n_classes):
    model.eval()
    logits = model(torch.from_numpy(X).to(device))
    pred = logits.argmax(1).cpu().numpy()
    acc = float((pred == y).mean())
    per_class = [float((pred[y == c] == c).mean()) if (y == c).any() else float("nan")
                 for c in range(n_classes)]
    return acc, per_class


def main():
    args = options()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    X_tr, y_tr = read_split(args.har_dir, "train")
    X_te, y_te = read_split(args.har_dir, "test")
    parts = dirichlet_partition(y_tr, world, args.alpha, np.random.default_rng(args.seed))
    X_local, y_local = X_tr[parts[rank]], y_tr[parts[rank]]

    mu, sd = federated_standardizer(X_local, device)
    X_local = (X_local - mu) / sd
    X_te = (X_te - mu) / sd

    in_dim = X_local.shape[1]
    n_classes = len(np.unique(y_local))
    model = HARNet(in_dim, args.hidden, n_classes).to(device)
    for p in model.parameters():
        dist.broadcast(p.data, src=0)

    loader = DataLoader(TensorDataset(torch.from_numpy(X_local), torch.from_numpy(y_local)),
                        batch_size=args.batch_size, shuffle=True, drop_last=False)
    print(f"[client {rank}] {len(y_local)} windows, label counts "
          f"{np.bincount(y_local, minlength=6).tolist()}", flush=True)

    best = 0.0
    for rnd in range(1, args.rounds + 1):
        t0 = time.time()
        loss = local_fit(model, loader, args, device)
        weighted_average(model, len(y_local), device)
        loss_t = torch.tensor([loss * len(y_local), float(len(y_local))], device=device)
        dist.all_reduce(loss_t)
        if rank == 0:
            acc, per_cls = evaluate(model, X_te, y_te, device, n_classes)
            print(f"round {rnd:3d} | train loss {(loss_t[0] / loss_t[1]).item():.4f} | "
                  f"test acc {acc:.4f} | per-class {np.round(per_cls, 3).tolist()} | "
                  f"{time.time() - t0:.2f}s", flush=True)
            if acc > best:
                best = acc
                os.makedirs(args.out, exist_ok=True)
                torch.save({"model": model.state_dict(), "mean": mu, "std": sd, "round": rnd},
                           os.path.join(args.out, "har_best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
