"""FedDyn (Acar et al., ICLR 2021) on CIFAR-10, one spawned process per GPU.

Each process is a client with a Dirichlet(alpha) shard. Full participation.
Client objective:
    L_k(w) - <g_k, w> + alpha/2 * ||w - w_server||^2
with the local state g_k updated after every round; the server keeps the
running correction h.

    python 17_feddyn_cifar10_spawn.py --world_size 4 --feddyn_alpha 0.01
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.utils import parameters_to_vector, vector_to_parameters
from torch.utils.data import DataLoader, Subset


class Cifar10CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 5), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(64 * 5 * 5, 384), nn.ReLU(),
            nn.Linear(384, 192), nn.ReLU(), nn.Linear(192, 10),
        )

    def forward(self, x):
        return self.classifier(self.features(x))


def dirichlet_shards(targets, n, alpha, seed):
    rng = np.random.default_rng(seed)
    targets = np.asarray(targets)
    shards = [[] for _ in range(n)]
    for c in range(10):
        ids = rng.permutation(np.where(targets == c)[0])
        p = rng.dirichlet(np.full(n, alpha))
        for k, part in enumerate(np.split(ids, (np.cumsum(p)[:-1] * len(ids)).astype(int))):
            shards[k].extend(part.tolist())
    return shards


def local_feddyn(model, loader, w_server, g_local, cfg, device):
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, weight_decay=1e-3)
    total, steps = 0.0, 0
    for _ in range(cfg.local_epochs):
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            ce = F.cross_entropy(model(x), y)
            w = parameters_to_vector(model.parameters())
            lin = torch.dot(g_local, w)
            quad = 0.5 * cfg.feddyn_alpha * torch.sum((w - w_server) ** 2)
            loss = ce - lin + quad
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            total += ce.item()
            steps += 1
    return total / max(steps, 1)


@torch.no_grad()
def test_global(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        acc[0] += (model(x).argmax(1) == y).sum()
        acc[1] += y.numel()
    dist.all_reduce(acc)
    return (acc[0] / acc[1]).item()


def run_worker(rank, world_size, cfg):
    os.environ["MASTER_ADDR"] = cfg.master_addr
    os.environ["MASTER_PORT"] = str(cfg.master_port)
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    torch.manual_seed(cfg.seed)

    norm = T.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    train = torchvision.datasets.CIFAR10(
        cfg.data, train=True,
        transform=T.Compose([T.RandomCrop(32, 4), T.RandomHorizontalFlip(), T.ToTensor(), norm]))
    test = torchvision.datasets.CIFAR10(cfg.data, train=False, transform=T.Compose([T.ToTensor(), norm]))
    shard = dirichlet_shards(train.targets, world_size, cfg.alpha, cfg.seed)[rank]
    loader = DataLoader(Subset(train, shard), batch_size=cfg.batch_size, shuffle=True,
                        num_workers=2, pin_memory=True)
    test_loader = DataLoader(Subset(test, range(rank, len(test), world_size)), batch_size=500)

    model = Cifar10CNN().to(device)
    w_server = parameters_to_vector(model.parameters()).detach().clone()
    dist.broadcast(w_server, src=0)
    vector_to_parameters(w_server, model.parameters())
    g_local = torch.zeros_like(w_server)
    h_server = torch.zeros_like(w_server)

    for rnd in range(1, cfg.rounds + 1):
        t0 = time.time()
        loss = local_feddyn(model, loader, w_server, g_local, cfg, device)
        with torch.no_grad():
            w_k = parameters_to_vector(model.parameters()).detach()
            g_local -= cfg.feddyn_alpha * (w_k - w_server)

            # server step (uniform weights, full participation)
            w_mean = w_k.clone()
            dist.all_reduce(w_mean)
            w_mean /= world_size
            h_server -= cfg.feddyn_alpha * (w_mean - w_server)
            w_server = w_mean - h_server / cfg.feddyn_alpha
            vector_to_parameters(w_server, model.parameters())

        lt = torch.tensor([loss], device=device)
        dist.all_reduce(lt)
        if rnd % cfg.eval_every == 0:
            acc = test_global(model, test_loader, device)
            if rank == 0:
                print(f"[round {rnd:4d}] loss {lt.item() / world_size:.4f} acc {acc:.4f} "
                      f"({time.time() - t0:.1f}s)", flush=True)
                torch.save({"round": rnd, "w_server": w_server.cpu(), "h": h_server.cpu()},
                           os.path.join(cfg.out, "feddyn_server.pt"))

    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--world_size", type=int, default=4)
    parser.add_argument("--master_addr", default="localhost")
    parser.add_argument("--master_port", type=int, default=29533)
    parser.add_argument("--data", default="./data/cifar10")
    parser.add_argument("--out", default="./checkpoints/feddyn")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--local_epochs", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=50)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--feddyn_alpha", type=float, default=0.01)
    parser.add_argument("--alpha", type=float, default=0.3, help="Dirichlet concentration")
    parser.add_argument("--eval_every", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    cfg = parser.parse_args()

    os.makedirs(cfg.out, exist_ok=True)
    torchvision.datasets.CIFAR10(cfg.data, train=True, download=True)
    torchvision.datasets.CIFAR10(cfg.data, train=False, download=True)
    mp.spawn(run_worker, args=(cfg, cfg.world_size), nprocs=cfg.world_size, join=True)


if __name__ == "__main__":
    main()
