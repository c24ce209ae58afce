"""Elastic Weight Consolidation on Permuted MNIST (domain-incremental).

Multi-GPU via torch.multiprocessing.spawn (one process per GPU), so it can be
started with plain `python` on our workstations:

    python 03_ewc_permuted_mnist.py --gpus 4 --tasks 10 --ewc_lambda 5000
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


class Permute:
    """Fixed pixel permutation applied to a flattened 28x28 image."""

    def __init__(self, perm):
        self.perm = torch.as_tensor(perm, dtype=torch.long)

    def __call__(self, img):
        return img.view(-1)[self.perm]


class MLP(nn.Module):
    def __init__(self, hidden=400, n_classes=10, p_drop=0.2):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(784, hidden), nn.ReLU(), nn.Dropout(p_drop),
            nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(p_drop),
            nn.Linear(hidden, n_classes),
        )

    def forward(self, x):
        return self.net(x)


def make_task(root, perm, train):
    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,)), Permute(perm)])
    return datasets.MNIST(root, train=train, download=False, transform=tf)


def estimate_fisher(net, loader, device):
    """Diagonal empirical Fisher on this rank's shard, summed over samples."""
    fisher = {n: torch.zeros_like(p) for n, p in net.named_parameters() if p.requires_grad}
    net.eval()
    n_samples = 0
    for x, _ in loader:
        x = x.to(device, non_blocking=True)
        out = net(x)
        pred = out.argmax(1)
        loss = F.cross_entropy(out, pred)
        net.zero_grad(set_to_none=True)
        loss.backward()
        for n, p in net.named_parameters():
            if p.grad is not None:
                fisher[n] += p.grad.detach() ** 2 * x.size(0)
        n_samples += x.size(0)
    return fisher, n_samples


def ewc_penalty(net, fisher, old_params):
    loss = 0.0
    for n, p in net.named_parameters():
        if n in fisher:
            loss = loss + (fisher[n] * (p - old_params[n]) ** 2).sum()
    return loss


@torch.no_grad()
def evaluate(net, dataset, rank, world, device):
    # every rank takes a strided slice of the test set; no padding
    shard = Subset(dataset, list(range(rank, len(dataset), world)))
    loader = DataLoader(shard, batch_size=1000, num_workers=2)
    net.eval()
    stats = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        stats[0] += (net(x).argmax(1) == y).sum()
        stats[1] += y.numel()
    dist.all_reduce(stats)
    return (100.0 * stats[0] / stats[1]).item()


def worker(rank, world_size, args):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    # per-rank seed only affects dropout; DDP broadcasts rank 0's initial weights
    torch.manual_seed(args.seed + rank)

    rng = np.random.RandomState(args.seed)
    perms = [np.arange(784)] + [rng.permutation(784) for _ in range(args.tasks - 1)]
    test_sets = [make_task(args.data, p, train=False) for p in perms]

    net = MLP(args.hidden).to(device)
    model = DDP(net, device_ids=[rank])
    fisher, old_params = None, None
    acc = np.zeros((args.tasks, args.tasks))
    per_gpu_bs = args.batch_size // world_size

    for t in range(args.tasks):
        train_set = make_task(args.data, perms[t], train=True)
        sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
        loader = DataLoader(train_set, batch_size=per_gpu_bs, sampler=sampler, num_workers=4, pin_memory=True)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            tic = time.time()
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                loss = F.cross_entropy(model(x), y)
                if fisher is not None:
                    loss = loss + 0.5 * args.ewc_lambda * ewc_penalty(net, fisher, old_params)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            if rank == 0:
                print(f"task {t} epoch {epoch} last loss {loss.item():.4f} ({time.time() - tic:.1f}s)", flush=True)

        # Fisher of the task just learned: local estimate with the bare module, then summed over ranks
        fisher_loader = DataLoader(train_set, batch_size=per_gpu_bs, sampler=sampler, num_workers=4)
        new_fisher, n_local = estimate_fisher(net, fisher_loader, device)
        n_total = torch.tensor([n_local], dtype=torch.float32, device=device)
        dist.all_reduce(n_total)
        for n in new_fisher:
            dist.all_reduce(new_fisher[n])
            new_fisher[n] /= n_total
        if fisher is None:
            fisher = new_fisher
        else:
            fisher = {n: fisher[n] + new_fisher[n] for n in fisher}
        old_params = {n: p.detach().clone() for n, p in net.named_parameters()}
        net.zero_grad(set_to_none=True)

        for j in range(t + 1):
            acc[t, j] = evaluate(net, test_sets[j], rank, world_size, device)
        if rank == 0:
            print(f"after task {t}: {np.round(acc[t, :t + 1], 2).tolist()} mean {acc[t, :t + 1].mean():.2f}",
                  flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"task": t, "model": net.state_dict(), "fisher": fisher, "old_params": old_params},
                       os.path.join(args.out, f"ewc_task{t}.pt"))

    if rank == 0:
        with open(os.path.join(args.out, "acc.json"), "w") as f:
            json.dump({"acc": acc.tolist(), "avg": float(acc[-1].mean())}, f)
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="./data")
    parser.add_argument("--out", default="./results/ewc_pmnist")
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    parser.add_argument("--tasks", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch_size", type=int, default=256, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--hidden", type=int, default=400)
    parser.add_argument("--ewc_lambda", type=float, default=5000.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=29533)
    args = parser.parse_args()

    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
