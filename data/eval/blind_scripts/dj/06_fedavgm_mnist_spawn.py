"""FedAvgM (FedAvg with server momentum) on MNIST, one process per GPU.

Clients are simulated by processes started with torch.multiprocessing.spawn,
so the script is run with plain python on a single node:

    python 06_fedavgm_mnist_spawn.py --gpus 4 --alpha 0.1 --server_momentum 0.9
"""
import argparse
import os
import socket
import time
from contextlib import closing

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset
from torchvision import datasets, transforms


def free_port():
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class MLP2NN(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(784, 200), nn.ReLU(),
                                 nn.Linear(200, 200), nn.ReLU(), nn.Linear(200, 10))

    def forward(self, x):
        return self.net(x)


def dirichlet_split(y, n_clients, alpha, seed, min_size=10):
    rng = np.random.default_rng(seed)
    for _ in range(1000):
        parts = [[] for _ in range(n_clients)]
        for c in range(10):
            ids = rng.permutation(np.where(y == c)[0])
            q = rng.dirichlet(np.full(n_clients, alpha))
            edges = (np.cumsum(q) * len(ids)).astype(int)[:-1]
            for k, chunk in enumerate(np.split(ids, edges)):
                parts[k] += chunk.tolist()
        if min(map(len, parts)) >= min_size:
            return parts
    raise RuntimeError("could not draw a partition with min_size samples per client")


def client_round(model, loader, cfg, device):
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    model.train()
    tot, n = 0.0, 0
    for _ in range(cfg.local_epochs):
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            out = model(x)
            loss = F.cross_entropy(out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            tot += loss.item() * len(y)
            n += len(y)
    return tot / max(n, 1)


@torch.no_grad()
def sharded_eval(model, dataset, rank, world_size, device):
    model.eval()
    idx = list(range(rank, len(dataset), world_size))
    loader = DataLoader(Subset(dataset, idx), batch_size=2000)
    acc = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        acc[0] += (model(x).argmax(1) == y).sum()
        acc[1] += len(y)
    dist.all_reduce(acc)
    return (acc[0] / acc[1]).item()


def worker(rank, world_size, cfg):
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    torch.manual_seed(cfg.seed)

    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    train = datasets.MNIST(cfg.data, train=True, transform=tf)
    test = datasets.MNIST(cfg.data, train=False, transform=tf)
    parts = dirichlet_split(train.targets.numpy(), world_size, cfg.alpha, cfg.seed)
    n_local = len(parts[rank])
    loader = DataLoader(Subset(train, parts[rank]), batch_size=cfg.batch_size, shuffle=True,
                        num_workers=2, persistent_workers=True)

    model = MLP2NN().to(device)
    params = list(model.parameters())
    momentum_buf = [torch.zeros_like(p) for p in params]

    n = torch.tensor([n_local], dtype=torch.float32, device=device)
    dist.all_reduce(n)
    w = n_local / n.item()

    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)
        print(f"{world_size} clients, sizes from {n_local} (rank 0), total {int(n.item())}")

    for rnd in range(1, cfg.rounds + 1):
        t0 = time.time()
        start = [p.detach().clone() for p in params]
        loss = client_round(model, loader, cfg, device)

        with torch.no_grad():
            # pseudo-gradient: weighted mean of (start - local)
            pseudo = [(s - p) * w for s, p in zip(start, params)]
            for g in pseudo:
                dist.all_reduce(g)
            for p, s, g, m in zip(params, start, pseudo, momentum_buf):
                m.mul_(cfg.server_momentum).add_(g)
                p.copy_(s - cfg.server_lr * m)

        lt = torch.tensor([loss * w], device=device)
        dist.all_reduce(lt)
        if rnd % cfg.eval_every == 0:
            acc = sharded_eval(model, test, rank, world_size, device)
            if rank == 0:
                print(f"round {rnd:3d}  train loss {lt.item():.4f}  test acc {acc:.4f}  "
                      f"({time.time() - t0:.2f}s)", flush=True)
                torch.save({"round": rnd, "model": model.state_dict(),
                            "server_momentum": momentum_buf}, os.path.join(cfg.out, "fedavgm.pt"))

    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--data", default="./data")
    ap.add_argument("--out", default="./ckpt/fedavgm_mnist")
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--local_epochs", type=int, default=1)
    ap.add_argument("--batch_size", type=int, default=50)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--server_lr", type=float, default=1.0)
    ap.add_argument("--server_momentum", type=float, default=0.9)
    ap.add_argument("--alpha", type=float, default=0.1)
    ap.add_argument("--eval_every", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    cfg = ap.parse_args()

    # fetch the data once in the parent so the workers never race on it
    datasets.MNIST(cfg.data, train=True, download=True)
    datasets.MNIST(cfg.data, train=False, download=True)

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(worker, args=(cfg.gpus, cfg), nprocs=cfg.gpus, join=True)


if __name__ == "__main__":
    main()
