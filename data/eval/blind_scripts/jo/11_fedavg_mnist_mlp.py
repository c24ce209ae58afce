"""
Simple FedAvg baseline (McMahan et al. 2017, "2NN") on MNIST, pathological non-IID split:
sort by label, cut into 200 shards of 300 images, give every client 2 shards.

Clients are simulated by several processes so that the 100-client experiments
finish in minutes:

    torchrun --nproc_per_node=4 11_fedavg_mnist_mlp.py --C 0.1 --E 5 --B 10
"""
import argparse
import csv
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torchvision import datasets

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def get_args():
    parser = argparse.ArgumentParser(description="FedAvg MNIST 2NN")
    parser.add_argument("--data", default="./data")
    parser.add_argument("--K", type=int, default=100, help="number of clients")
    parser.add_argument("--C", type=float, default=0.1, help="fraction of clients per round")
    parser.add_argument("--E", type=int, default=5, help="local epochs")
    parser.add_argument("--B", type=int, default=10, help="local batch size")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--target-acc", type=float, default=0.97)
    parser.add_argument("--iid", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--csv", default="results/fedavg_mnist_2nn.csv")
    return parser.parse_args()


class TwoNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 200)
        self.fc2 = nn.Linear(200, 200)
        self.fc3 = nn.Linear(200, 10)

    def forward(self, x):
        x = x.view(x.size(0), -1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def make_clients(labels, K, iid, seed):
    rng = np.random.default_rng(seed)
    n = len(labels)
    if iid:
        return np.array_split(rng.permutation(n), K)
    order = np.argsort(labels, kind="stable")
    shards = np.array_split(order, 2 * K)
    shard_ids = rng.permutation(2 * K)
    return [np.concatenate([shards[shard_ids[2 * k]], shards[shard_ids[2 * k + 1]]]) for k in range(K)]


def client_update(model, x, y, E, B, lr):
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    n = x.size(0)
    for _ in range(E):
        perm = torch.randperm(n, device=x.device)
        for i in range(0, n, B):
            idx = perm[i:i + B]
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()


@torch.no_grad()
def evaluate(model, x, y, rank, world):
    model.eval()
    xs, ys = x[rank::world], y[rank::world]
    logits = model(xs)
    res = torch.stack([
        F.cross_entropy(logits, ys, reduction="sum"),
        (logits.argmax(1) == ys).sum().float(),
        torch.tensor(float(ys.numel()), device=ys.device),
    ])
    dist.all_reduce(res)
    return (res[0] / res[2]).item(), (res[1] / res[2]).item()


def main():
    args = get_args()
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    # the whole of MNIST fits easily on every GPU; keep it resident
    if rank == 0:
        datasets.MNIST(args.data, train=True, download=True)
        datasets.MNIST(args.data, train=False, download=True)
    dist.barrier()
    train = datasets.MNIST(args.data, train=True)
    test = datasets.MNIST(args.data, train=False)
    x_train = ((train.data.float() / 255.0 - 0.1307) / 0.3081).to(DEVICE)
    y_train = train.targets.to(DEVICE)
    x_test = ((test.data.float() / 255.0 - 0.1307) / 0.3081).to(DEVICE)
    y_test = test.targets.to(DEVICE)

    clients = make_clients(train.targets.numpy(), args.K, args.iid, args.seed)
    clients = [torch.as_tensor(c, device=DEVICE) for c in clients]
    m = max(int(args.C * args.K), 1)

    global_model = TwoNN().to(DEVICE)
    local_model = TwoNN().to(DEVICE)
    for p in global_model.parameters():
        dist.broadcast(p.data, src=0)

    rows = []
    reached = None
    t_start = time.time()
    for rnd in range(1, args.rounds + 1):
        sel = np.random.default_rng(args.seed + rnd).choice(args.K, m, replace=False)
        agg = [torch.zeros_like(p) for p in global_model.parameters()]
        n_k = torch.zeros(1, device=DEVICE)
        for k in sel[rank::world]:
            local_model.load_state_dict(global_model.state_dict())
            idx = clients[k]
            client_update(local_model, x_train[idx], y_train[idx], args.E, args.B, args.lr)
            for a, p in zip(agg, local_model.parameters()):
                a.add_(p.detach(), alpha=len(idx))
            n_k += len(idx)

        dist.all_reduce(n_k)
        with torch.no_grad():
            for a, p in zip(agg, global_model.parameters()):
                dist.all_reduce(a)
                p.copy_(a / n_k)

        loss, acc = evaluate(global_model, x_test, y_test, rank, world)
        rows.append((rnd, loss, acc, time.time() - t_start))
        if rank == 0 and (rnd % 20 == 0 or acc >= args.target_acc):
            print(f"round {rnd:4d}  test loss {loss:.4f}  acc {acc:.4f}", flush=True)
        if reached is None and acc >= args.target_acc:
            reached = rnd
            if rank == 0:
                print(f"reached {args.target_acc:.2%} after {rnd} rounds", flush=True)

    if rank == 0:
        os.makedirs(os.path.dirname(args.csv), exist_ok=True)
        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["round", "test_loss", "test_acc", "elapsed_s"])
            w.writerows(rows)
        torch.save(global_model.state_dict(), args.csv.replace(".csv", ".pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
