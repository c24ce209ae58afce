"""FedAvg on Fashion-MNIST with quantity skew + label skew.

Every client gets a private 80/20 train/test split of its own data, and the
global model is scored on the union of the client test splits (the usual
"average over clients" federated accuracy). Clients are spread round-robin
over ranks and stay there for the whole run.

    torchrun --nproc_per_node=4 15_fedavg_fashion_mnist.py --clients 200 --frac 0.1
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torchvision import datasets


def args_():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/fmnist")
    p.add_argument("--out", default="results/fmnist_fedavg")
    p.add_argument("--clients", type=int, default=200)
    p.add_argument("--frac", type=float, default=0.1)
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--local-epochs", type=int, default=2)
    p.add_argument("--bs", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--sigma", type=float, default=1.0, help="log-normal quantity skew")
    p.add_argument("--seed", type=int, default=8)
    return p.parse_args()


class LeNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(1, 6, 5, padding=2)
        self.c2 = nn.Conv2d(6, 16, 5)
        self.f1 = nn.Linear(16 * 5 * 5, 120)
        self.f2 = nn.Linear(120, 84)
        self.f3 = nn.Linear(84, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        x = F.max_pool2d(F.relu(self.c2(x)), 2)
        x = x.flatten(1)
        return self.f3(F.relu(self.f2(F.relu(self.f1(x)))))


def split_clients(y, n_clients, alpha, sigma, seed):
    """Label skew (Dirichlet over classes per client) combined with log-normal client sizes."""
    rng = np.random.default_rng(seed)
    sizes = rng.lognormal(0, sigma, n_clients)
    sizes = np.maximum((sizes / sizes.sum() * len(y)).astype(int), 20)
    pools = {c: list(rng.permutation(np.where(y == c)[0])) for c in range(10)}
    clients = []
    for k in range(n_clients):
        p = rng.dirichlet([alpha] * 10)
        want = rng.multinomial(sizes[k], p)
        idx = []
        for c in range(10):
            take = min(want[c], len(pools[c]))
            idx += pools[c][:take]
            pools[c] = pools[c][take:]
        clients.append(np.array(rng.permutation(idx), dtype=np.int64))
    return clients


def train_local(model, x, y, epochs, bs, lr):
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.5)
    for _ in range(epochs):
        perm = torch.randperm(len(y), device=y.device)
        for i in range(0, len(y), bs):
            b = perm[i:i + bs]
            opt.zero_grad()
            F.cross_entropy(model(x[b]), y[b]).backward()
            opt.step()


@torch.no_grad()
def client_eval(model, tests):
    model.eval()
    per_client = []
    correct = total = 0
    for x, y in tests:
        if len(y) == 0:
            continue
        c = (model(x).argmax(1) == y).sum().item()
        per_client.append(c / len(y))
        correct += c
        total += len(y)
    return correct / max(total, 1), float(np.mean(per_client)) if per_client else 0.0


def main():
    a = args_()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(a.seed + rank)

    ds = datasets.FashionMNIST(a.data, train=True)
    X = ((ds.data.float() / 255.0 - 0.2860) / 0.3530).unsqueeze(1)
    Y = ds.targets.clone()
    clients = split_clients(Y.numpy(), a.clients, a.alpha, a.sigma, a.seed)

    # each rank materialises only its own clients on the GPU
    local = {}
    for k in range(rank, a.clients, world):
        idx = torch.from_numpy(clients[k])
        cut = int(0.8 * len(idx))
        tr, te = idx[:cut], idx[cut:]
        local[k] = ((X[tr].to(dev), Y[tr].to(dev)), (X[te].to(dev), Y[te].to(dev)))

    model = LeNet().to(dev)
    tmp = LeNet().to(dev)
    for p in model.parameters():
        dist.broadcast(p.data, 0)

    m = max(1, int(a.frac * a.clients))
    log, best = [], 0.0
    os.makedirs(a.out, exist_ok=True)
    for r in range(1, a.rounds + 1):
        t0 = time.time()
        chosen = np.random.default_rng(a.seed * 7 + r).choice(a.clients, m, replace=False)
        sums = [torch.zeros_like(p) for p in model.parameters()]
        n = torch.zeros(1, device=dev)
        for k in chosen:
            if k not in local:
                continue
            (xtr, ytr), _ = local[k]
            tmp.load_state_dict(model.state_dict())
            train_local(tmp, xtr, ytr, a.local_epochs, a.bs, a.lr)
            for s, p in zip(sums, tmp.parameters()):
                s.add_(p.detach(), alpha=len(ytr))
            n += len(ytr)

        dist.all_reduce(n)
        for s in sums:
            dist.all_reduce(s)
        with torch.no_grad():
            for p, s in zip(model.parameters(), sums):
                p.copy_(s / n)

        if r % 5 == 0:
            acc, mean_client_acc = client_eval(model, [te for _, te in local.values()])
            if rank == 0:
                log.append({"round": r, "acc": acc, "mean_client_acc": mean_client_acc,
                            "sec": round(time.time() - t0, 2)})
                print(f"round {r:4d} | acc {acc:.4f} | mean client acc {mean_client_acc:.4f}", flush=True)
                if acc > best:
                    best = acc
                    torch.save(model.state_dict(), os.path.join(a.out, "best.pt"))

    if rank == 0:
        with open(os.path.join(a.out, "log.json"), "w") as f:
            json.dump({"args": vars(a), "log": log, "best_acc": best}, f, indent=2)
        torch.save(model.state_dict(), os.path.join(a.out, "final.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
