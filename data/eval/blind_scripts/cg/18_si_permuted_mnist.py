"""Synaptic Intelligence (Zenke et al., 2017) on Permuted-MNIST (domain-incremental, 10 tasks).

The importance of each weight is accumulated from the parameter trajectory; since DDP keeps the
replicas identical, every rank accumulates the same path integral.

    torchrun --nproc_per_node=2 18_si_permuted_mnist.py --tasks 10 --c 0.1 --out results/si_pmnist
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets


class PermutedMNIST(Dataset):
    def __init__(self, base, perm):
        self.x = base.data.view(len(base), -1).float().div(255)[:, perm]
        self.x = (self.x - 0.1307) / 0.3081
        self.y = base.targets.clone()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class MLP(nn.Module):
    def __init__(self, hidden=1000):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(784, hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, 10))

    def forward(self, x):
        return self.net(x)


class SynapticIntelligence:
    def __init__(self, module, c, xi=0.1):
        self.c, self.xi = c, xi
        self.params = dict(module.named_parameters())
        self.omega = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self.w = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self.prev = {n: p.detach().clone() for n, p in self.params.items()}
        self.start = {n: p.detach().clone() for n, p in self.params.items()}

    def surrogate(self):
        return self.c * sum((self.omega[n] * (p - self.start[n]) ** 2).sum() for n, p in self.params.items())

    @torch.no_grad()
    def before_step(self):
        self.grads = {n: p.grad.detach().clone() for n, p in self.params.items() if p.grad is not None}

    @torch.no_grad()
    def after_step(self):
        for n, p in self.params.items():
            if n in self.grads:
                self.w[n] -= self.grads[n] * (p - self.prev[n])
            self.prev[n] = p.detach().clone()

    @torch.no_grad()
    def consolidate(self):
        for n, p in self.params.items():
            delta = p - self.start[n]
            self.omega[n] += self.w[n] / (delta ** 2 + self.xi)
            self.w[n].zero_()
            self.start[n] = p.detach().clone()


@torch.no_grad()
def test_task(module, ds, device, rank, world):
    module.eval()
    xs, ys = ds.x[rank::world], ds.y[rank::world]
    correct = 0
    for i in range(0, len(ys), 2000):
        pred = module(xs[i:i + 2000].to(device)).argmax(1).cpu()
        correct += (pred == ys[i:i + 2000]).sum().item()
    stats = torch.tensor([correct, len(ys)], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    module.train()
    return 100.0 * stats[0].item() / stats[1].item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="./data")
    ap.add_argument("--out", default="results/si_pmnist")
    ap.add_argument("--tasks", type=int, default=10)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--c", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    if rank == 0:
        datasets.MNIST(args.data, train=True, download=True)
        datasets.MNIST(args.data, train=False, download=True)
    dist.barrier()
    mnist_tr = datasets.MNIST(args.data, train=True)
    mnist_te = datasets.MNIST(args.data, train=False)
    # task 0 is plain MNIST, the others use a fixed random pixel permutation
    perms = [np.arange(784)] + [np.random.RandomState(args.seed + t).permutation(784)
                                for t in range(1, args.tasks)]
    test_sets = [PermutedMNIST(mnist_te, p) for p in perms]

    net = MLP().to(device)
    model = DDP(net, device_ids=[local_rank])
    si = SynapticIntelligence(net, args.c)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))
    R = np.zeros((args.tasks, args.tasks))

    for t in range(args.tasks):
        train_ds = PermutedMNIST(mnist_tr, perms[t])
        sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
        loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, drop_last=True)
        tic = time.time()
        for ep in range(args.epochs):
            sampler.set_epoch(ep)
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                loss = F.cross_entropy(model(x), y)
                if t > 0:
                    loss = loss + si.surrogate()
                opt.zero_grad()
                loss.backward()
                si.before_step()
                opt.step()
                si.after_step()
        si.consolidate()

        for j in range(t + 1):
            R[t, j] = test_task(net, test_sets[j], device, rank, world)
        if rank == 0:
            bwt = np.mean([R[t, j] - R[j, j] for j in range(t)]) if t else 0.0
            print(f"task {t + 1}/{args.tasks} ({time.time() - tic:.0f}s): "
                  f"avg acc {R[t, :t + 1].mean():.2f}  BWT {bwt:.2f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "results.json"), "w") as f:
                json.dump({"R": R.tolist(), "args": vars(args)}, f, indent=1)
            torch.save(net.state_dict(), os.path.join(args.out, "si_mlp.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
