"""Synaptic Intelligence (Zenke et al., 2017) on Split CIFAR-10/100, multi-head.

Task 0 is the full CIFAR-10, tasks 1..5 are 10-class chunks of CIFAR-100.
Each task has its own 10-way output head on top of a shared conv trunk.

    torchrun --nproc_per_node=4 06_si_multihead_cifar.py --si-c 0.1
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
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--cifar10", default="/datasets/cifar10")
    p.add_argument("--cifar100", default="/datasets/cifar100")
    p.add_argument("--out", default="./si_runs")
    p.add_argument("--n-cifar100-tasks", type=int, default=5)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=256, help="global batch size")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--si-c", type=float, default=0.1)
    p.add_argument("--si-eps", type=float, default=1e-3)
    p.add_argument("--workers", type=int, default=4)
    return p.parse_args()


class ConvTrunk(nn.Module):
    """The 4-conv / 2-fc network used in the SI paper."""

    def __init__(self, n_tasks, n_out=10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 32, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Dropout(0.25),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.Conv2d(64, 64, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Dropout(0.25),
        )
        self.fc = nn.Sequential(nn.Flatten(), nn.Linear(64 * 6 * 6, 512), nn.ReLU(), nn.Dropout(0.5))
        self.heads = nn.ModuleList([nn.Linear(512, n_out) for _ in range(n_tasks)])

    def forward(self, x, task_id):
        h = self.fc(self.features(x))
        return self.heads[task_id](h)


class SI:
    def __init__(self, net, c, eps):
        self.c, self.eps = c, eps
        self.params = {n: p for n, p in net.named_parameters()}
        self.prev = {n: p.detach().clone() for n, p in self.params.items()}
        self.w = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self.omega = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self.anchor = {n: p.detach().clone() for n, p in self.params.items()}

    def before_step(self):
        self._old = {n: p.detach().clone() for n, p in self.params.items()}

    def after_step(self):
        # path integral: -grad * delta, grads are already all-reduced by DDP
        for n, p in self.params.items():
            if p.grad is not None:
                self.w[n] -= p.grad.detach() * (p.detach() - self._old[n])

    def surrogate_loss(self):
        loss = 0.0
        for n, p in self.params.items():
            loss = loss + (self.omega[n] * (p - self.anchor[n]) ** 2).sum()
        return self.c * loss

    def consolidate(self):
        for n, p in self.params.items():
            delta = p.detach() - self.prev[n]
            self.omega[n] += self.w[n] / (delta ** 2 + self.eps)
            self.w[n].zero_()
            self.prev[n] = p.detach().clone()
            self.anchor[n] = p.detach().clone()


def build_tasks(args):
    norm = transforms.Normalize((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    tr = transforms.Compose([transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm])
    te = transforms.Compose([transforms.ToTensor(), norm])
    tasks = [(datasets.CIFAR10(args.cifar10, True, tr), datasets.CIFAR10(args.cifar10, False, te), 0)]
    c100_tr = datasets.CIFAR100(args.cifar100, True, tr)
    c100_te = datasets.CIFAR100(args.cifar100, False, te)
    ytr, yte = np.array(c100_tr.targets), np.array(c100_te.targets)
    for k in range(args.n_cifar100_tasks):
        lo, hi = 10 * k, 10 * (k + 1)
        tasks.append((Subset(c100_tr, np.where((ytr >= lo) & (ytr < hi))[0]),
                      Subset(c100_te, np.where((yte >= lo) & (yte < hi))[0]), lo))
    return tasks


@torch.no_grad()
def test(net, ds, task_id, offset, device, rank, world):
    net.eval()
    shard = Subset(ds, range(rank, len(ds), world))
    loader = DataLoader(shard, batch_size=500, num_workers=2)
    hits = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device) - offset
        hits[0] += (net(x, task_id).argmax(1) == y).sum()
        hits[1] += y.numel()
    dist.all_reduce(hits)
    net.train()
    return (hits[0] / hits[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    tasks = build_tasks(args)
    n_tasks = len(tasks)
    net = ConvTrunk(n_tasks).to(device)
    model = DDP(net, device_ids=[local_rank])
    si = SI(net, args.si_c, args.si_eps)
    bs = args.batch_size // world
    acc = np.zeros((n_tasks, n_tasks))

    for t, (train_ds, _, offset) in enumerate(tasks):
        sampler = DistributedSampler(train_ds, shuffle=True)
        loader = DataLoader(train_ds, batch_size=bs, sampler=sampler, num_workers=args.workers,
                            pin_memory=True, drop_last=True)
        # Adam state is reset at every task boundary, as in the paper
        opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))
        for ep in range(args.epochs):
            sampler.set_epoch(ep)
            start, tot = time.time(), 0.0
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), (y - offset).to(device, non_blocking=True)
                loss = F.cross_entropy(model(x, t), y)
                if t > 0:
                    loss = loss + si.surrogate_loss()
                opt.zero_grad()
                loss.backward()
                si.before_step()
                opt.step()
                si.after_step()
                tot += loss.item()
            if rank == 0 and (ep + 1) % 10 == 0:
                print(f"task {t} epoch {ep + 1}: loss {tot / len(loader):.4f} ({time.time() - start:.1f}s)")
        si.consolidate()

        for j in range(t + 1):
            acc[t, j] = test(net, tasks[j][1], j, tasks[j][2], device, rank, world)
        if rank == 0:
            print(f"after task {t}: {np.round(acc[t, :t + 1], 4).tolist()} mean {acc[t, :t + 1].mean():.4f}",
                  flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"net": net.state_dict(), "omega": si.omega, "task": t},
                       os.path.join(args.out, f"si_task{t}.pt"))
        dist.barrier()

    if rank == 0:
        with open(os.path.join(args.out, "acc_matrix.json"), "w") as f:
            json.dump(acc.tolist(), f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
