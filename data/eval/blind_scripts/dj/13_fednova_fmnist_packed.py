"""FedNova (Wang et al., 2020) on Fashion-MNIST with heterogeneous local work.

Clients run a number of local SGD steps proportional to their data size, so
plain FedAvg would be biased towards clients that do more steps; FedNova
normalises each update by its step count before averaging.

The models are tiny, so several client processes share one GPU:

    # 4-GPU box, 16 clients
    torchrun --nproc_per_node=16 13_fednova_fmnist_packed.py --clients_per_gpu 4
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset
from torchvision import datasets, transforms


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_root", default="~/.cache/fmnist")
    ap.add_argument("--out_dir", default="./out/fednova")
    ap.add_argument("--clients_per_gpu", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=150)
    ap.add_argument("--local_epochs", type=int, default=2)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--alpha", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=99)
    ap.add_argument("--eval_every", type=int, default=5)
    return ap.parse_args()


class FMNISTNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.drop = nn.Dropout(0.3)
        self.fc1 = nn.Linear(64 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = self.drop(torch.flatten(x, 1))
        return self.fc2(self.drop(F.relu(self.fc1(x))))


def dirichlet_clients(y, k, alpha, seed):
    rng = np.random.default_rng(seed)
    idx = [[] for _ in range(k)]
    for c in range(10):
        pool = rng.permutation(np.where(y == c)[0])
        frac = rng.dirichlet(alpha * np.ones(k))
        bounds = (np.cumsum(frac)[:-1] * len(pool)).astype(int)
        for j, part in enumerate(np.split(pool, bounds)):
            idx[j].extend(part.tolist())
    return idx


def run_client(model, loader, epochs, lr, device):
    """Plain SGD, so the FedNova normaliser a_i equals the number of steps."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    tau, loss_acc = 0, 0.0
    for _ in range(epochs):
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            tau += 1
            loss_acc += loss.item()
    return tau, loss_acc / max(tau, 1)


@torch.no_grad()
def eval_global(model, loader, device):
    model.eval()
    s = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        s[0] += (model(x).argmax(1) == y).sum()
        s[1] += len(y)
    dist.all_reduce(s)
    return (s[0] / s[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    gpu = local_rank // args.clients_per_gpu
    torch.cuda.set_device(gpu)
    device = torch.device("cuda", gpu)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)

    root = os.path.expanduser(args.data_root)
    if rank == 0:
        datasets.FashionMNIST(root, train=True, download=True)
        datasets.FashionMNIST(root, train=False, download=True)
    dist.barrier()
    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.286,), (0.353,))])
    train = datasets.FashionMNIST(root, train=True, transform=tf)
    test = datasets.FashionMNIST(root, train=False, transform=tf)

    split = dirichlet_clients(train.targets.numpy(), world, args.alpha, args.seed)
    n_i = len(split[rank])
    loader = DataLoader(Subset(train, split[rank]), batch_size=args.batch_size, shuffle=True,
                        num_workers=1, pin_memory=True)
    test_loader = DataLoader(Subset(test, range(rank, len(test), world)), batch_size=1000)

    model = FMNISTNet().to(device)
    params = list(model.parameters())

    n_total = torch.tensor([float(n_i)], device=device)
    dist.all_reduce(n_total)
    p_i = n_i / n_total.item()

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        print(f"{world} clients on {torch.cuda.device_count()} GPUs, "
              f"{int(n_total.item())} samples in total", flush=True)

    for rnd in range(1, args.rounds + 1):
        t0 = time.time()
        x0 = [p.detach().clone() for p in params]
        tau, loss = run_client(model, loader, args.local_epochs, args.lr, device)

        with torch.no_grad():
            # normalised update d_i = (x0 - y_i) / tau_i, weighted by p_i
            d = [(a - p) * (p_i / max(tau, 1)) for a, p in zip(x0, params)]
            for t in d:
                dist.all_reduce(t)
            tau_eff = torch.tensor([p_i * tau], device=device)
            dist.all_reduce(tau_eff)
            for p, a, g in zip(params, x0, d):
                p.copy_(a - tau_eff * g)

        lt = torch.tensor([loss * p_i], device=device)
        dist.all_reduce(lt)
        if rnd % args.eval_every == 0:
            acc = eval_global(model, test_loader, device)
            if rank == 0:
                print(f"round {rnd:3d} loss {lt.item():.4f} tau_eff {tau_eff.item():.1f} "
                      f"acc {acc:.4f} ({time.time() - t0:.1f}s)", flush=True)
                torch.save(model.state_dict(), os.path.join(args.out_dir, "fednova_global.pt"))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
