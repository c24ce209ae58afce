"""FedProx simulation on CIFAR-10: one client per GPU, started with mp.spawn.

Clients hold shards of very different size (Dirichlet label skew), run a fixed
number of local epochs with a proximal term, and the server aggregates the
client models weighted by their sample counts.  Clients never synchronise
during local training, so their differing numbers of local steps are fine.

    python fedprox_spawn_cifar10.py --clients 4 --rounds 100 --mu 0.01
"""
import argparse
import copy
import os
import socket
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset
from torchvision import datasets, transforms


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="./data")
    p.add_argument("--out", default="./fedprox_out")
    p.add_argument("--clients", type=int, default=torch.cuda.device_count())
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--local-epochs", type=int, default=5)
    p.add_argument("--bs", type=int, default=50)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--mu", type=float, default=0.01)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=2024)
    return p.parse_args()


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class SimpleCNN(nn.Module):
    """The 2-conv CNN from the FedAvg paper, with GroupNorm (no batch statistics)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 32, 5, padding=2), nn.GroupNorm(4, 32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5, padding=2), nn.GroupNorm(8, 64), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64 * 8 * 8, 512), nn.ReLU(), nn.Linear(512, 10))

    def forward(self, x):
        return self.body(x)


def partition(targets, n_clients, alpha, seed):
    rng = np.random.RandomState(seed)
    targets = np.asarray(targets)
    shards = [[] for _ in range(n_clients)]
    for c in range(10):
        idx = rng.permutation(np.where(targets == c)[0])
        p = rng.dirichlet([alpha] * n_clients)
        bounds = (np.cumsum(p)[:-1] * len(idx)).astype(int)
        for k, part in enumerate(np.split(idx, bounds)):
            shards[k] += part.tolist()
    return shards


def client_update(model, global_params, loader, args, device):
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    model.train()
    steps, total = 0, 0.0
    for _ in range(args.local_epochs):
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = F.cross_entropy(model(x), y)
            prox = sum(((p - g) ** 2).sum() for p, g in zip(model.parameters(), global_params))
            loss = loss + 0.5 * args.mu * prox
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
            total += loss.item()
    return total / max(steps, 1)


@torch.no_grad()
def aggregate(global_model, local_model, n_samples, device):
    w = torch.tensor(float(n_samples), device=device)
    w_sum = w.clone()
    dist.all_reduce(w_sum)
    for g, l in zip(global_model.parameters(), local_model.parameters()):
        buf = l.detach() * (w / w_sum)
        dist.all_reduce(buf)
        g.copy_(buf)


@torch.no_grad()
def server_eval(model, loader, device):
    model.eval()
    correct = n = 0
    for x, y in loader:
        out = model(x.to(device))
        correct += (out.argmax(1).cpu() == y).sum().item()
        n += len(y)
    return correct / n


def run_client(rank, world_size, port, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)

    tf_train = transforms.Compose([transforms.RandomCrop(32, 4), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(),
                                   transforms.Normalize((0.4914, 0.4822, 0.4465), (0.247, 0.243, 0.261))])
    tf_test = transforms.Compose([transforms.ToTensor(),
                                  transforms.Normalize((0.4914, 0.4822, 0.4465), (0.247, 0.243, 0.261))])
    train = datasets.CIFAR10(args.data, train=True, transform=tf_train)
    shards = partition(train.targets, world_size, args.alpha, args.seed)
    mine = shards[rank]
    loader = DataLoader(Subset(train, mine), batch_size=args.bs, shuffle=True,
                        num_workers=2, drop_last=False)

    torch.manual_seed(args.seed)  # same init on every client
    global_model = SimpleCNN().to(device)
    start = 1
    ckpt_path = os.path.join(args.out, "server.pt")
    if os.path.exists(ckpt_path):
        st = torch.load(ckpt_path, map_location=device)
        global_model.load_state_dict(st["model"])
        start = st["round"] + 1

    if rank == 0:
        test = datasets.CIFAR10(args.data, train=False, transform=tf_test)
        test_loader = DataLoader(test, batch_size=1000, num_workers=2)

    for rnd in range(start, args.rounds + 1):
        t0 = time.time()
        local = copy.deepcopy(global_model)
        anchor = [p.detach().clone() for p in global_model.parameters()]
        loss = client_update(local, anchor, loader, args, device)
        aggregate(global_model, local, len(mine), device)

        if rank == 0:
            acc = server_eval(global_model, test_loader, device)
            print(f"round {rnd:3d} | client0 loss {loss:.3f} | global acc {acc:.4f} | "
                  f"{time.time() - t0:.1f}s", flush=True)
            tmp = ckpt_path + ".tmp"
            torch.save({"model": global_model.state_dict(), "round": rnd}, tmp)
            os.replace(tmp, ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


def main():
    args = get_args()
    os.makedirs(args.out, exist_ok=True)
    datasets.CIFAR10(args.data, train=True, download=True)
    datasets.CIFAR10(args.data, train=False, download=True)
    port = free_port()
    mp.spawn(run_client, args=(args.clients, port, args), nprocs=args.clients, join=True)


if __name__ == "__main__":
    main()
