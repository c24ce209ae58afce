"""SCAFFOLD (Karimireddy et al., 2020) simulated with torch.distributed.

N virtual clients are spread round-robin over the ranks; every round a subset
of clients is sampled (identically on all ranks) and each rank trains the
sampled clients it owns, one after the other, on its GPU. Model deltas and
control-variate deltas are summed with all_reduce.

    torchrun --nproc_per_node=8 03_scaffold_cifar10_multiclient.py \
        --num_clients 100 --sample_frac 0.1 --alpha 0.1
"""
import argparse
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.utils.data import DataLoader, Subset

log = logging.getLogger(__name__)


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/cifar10")
    p.add_argument("--save_dir", default="outputs/scaffold")
    p.add_argument("--num_clients", type=int, default=100)
    p.add_argument("--sample_frac", type=float, default=0.1)
    p.add_argument("--rounds", type=int, default=500)
    p.add_argument("--local_steps", type=int, default=20)
    p.add_argument("--batch_size", type=int, default=50)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--server_lr", type=float, default=1.0)
    p.add_argument("--alpha", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--eval_every", type=int, default=10)
    return p.parse_args()


def dirichlet_indices(targets, n_clients, alpha, seed):
    rng = np.random.RandomState(seed)
    n_cls = targets.max() + 1
    out = [[] for _ in range(n_clients)]
    for c in range(n_cls):
        ids = np.where(targets == c)[0]
        rng.shuffle(ids)
        prop = rng.dirichlet([alpha] * n_clients)
        split_at = (np.cumsum(prop) * len(ids)).astype(int)[:-1]
        for i, chunk in enumerate(np.split(ids, split_at)):
            out[i].extend(chunk)
    return [np.asarray(o, dtype=np.int64) for o in out]


class ConvNet(nn.Module):
    def __init__(self, n_classes=10):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.fc = nn.Sequential(nn.Flatten(), nn.Linear(64 * 4 * 4, 256), nn.ReLU(),
                                nn.Linear(256, n_classes))

    def forward(self, x):
        return self.fc(self.body(x))


def cycle(loader):
    while True:
        yield from loader


def train_client(model, batches, c_global, c_local, args, device):
    """K local steps with the SCAFFOLD gradient correction; returns the new
    local control variate (option II) on the GPU."""
    x_global = [p.detach().clone() for p in model.parameters()]
    c_loc_dev = [c.to(device, non_blocking=True) for c in c_local]
    correction = [cg - cl for cg, cl in zip(c_global, c_loc_dev)]
    model.train()
    for _ in range(args.local_steps):
        x, y = next(batches)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = F.cross_entropy(model(x), y)
        model.zero_grad(set_to_none=True)
        loss.backward()
        with torch.no_grad():
            for p, corr in zip(model.parameters(), correction):
                p.add_(p.grad + corr, alpha=-args.lr)
    with torch.no_grad():
        scale = 1.0 / (args.local_steps * args.lr)
        c_new = [cl - cg + (xg - p) * scale
                 for cl, cg, xg, p in zip(c_loc_dev, c_global, x_global, model.parameters())]
    return x_global, c_new, loss.item()


@torch.no_grad()
def test(model, loader, device):
    model.eval()
    hit = tot = 0
    for x, y in loader:
        pred = model(x.to(device)).argmax(1)
        hit += (pred.cpu() == y).sum().item()
        tot += y.numel()
    return hit / tot


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(args.seed)

    norm = T.Normalize((0.4914, 0.4822, 0.4465), (0.247, 0.243, 0.261))
    train_set = torchvision.datasets.CIFAR10(
        args.data, train=True,
        transform=T.Compose([T.RandomCrop(32, 4), T.RandomHorizontalFlip(), T.ToTensor(), norm]))
    test_set = torchvision.datasets.CIFAR10(args.data, train=False,
                                            transform=T.Compose([T.ToTensor(), norm]))
    parts = dirichlet_indices(np.array(train_set.targets), args.num_clients, args.alpha, args.seed)
    sizes = np.array([len(p) for p in parts], dtype=np.float64)

    my_clients = list(range(rank, args.num_clients, world))
    loaders = {
        cid: cycle(DataLoader(Subset(train_set, parts[cid]), batch_size=args.batch_size,
                              shuffle=True, num_workers=0, drop_last=False))
        for cid in my_clients
    }
    log.info("rank %d owns %d clients (%d samples)", rank, len(my_clients),
             int(sizes[my_clients].sum()))

    model = ConvNet().to(device)
    for p in model.parameters():
        dist.broadcast(p.data, 0)
    c_global = [torch.zeros_like(p) for p in model.parameters()]
    # one control variate per virtual client; with 100 clients these would
    # take a lot of GPU memory, so they live in host memory between rounds
    c_locals = {cid: [torch.zeros_like(p, device="cpu") for p in model.parameters()]
                for cid in my_clients}
    test_loader = DataLoader(test_set, batch_size=1000, num_workers=4) if rank == 0 else None

    n_sample = max(1, int(args.sample_frac * args.num_clients))
    for rnd in range(args.rounds):
        t0 = time.time()
        rng = np.random.default_rng(args.seed * 100003 + rnd)
        sampled = rng.choice(args.num_clients, n_sample, replace=False)
        w = sizes[sampled] / sizes[sampled].sum()
        weight_of = dict(zip(sampled.tolist(), w.tolist()))

        x_start = [p.detach().clone() for p in model.parameters()]
        delta_x = [torch.zeros_like(p) for p in model.parameters()]
        delta_c = [torch.zeros_like(c) for c in next(iter(c_locals.values()))]
        last_loss = 0.0
        for cid in my_clients:
            if cid not in weight_of:
                continue
            with torch.no_grad():
                for p, xs in zip(model.parameters(), x_start):
                    p.copy_(xs)
            _, c_new, last_loss = train_client(model, loaders[cid], c_global, c_locals[cid],
                                               args, device)
            with torch.no_grad():
                for dx, p, xs in zip(delta_x, model.parameters(), x_start):
                    dx.add_(p - xs, alpha=weight_of[cid])
                for dc, cn, co in zip(delta_c, c_new, c_locals[cid]):
                    dc.add_(cn.cpu() - co)
            c_locals[cid] = [c.cpu() for c in c_new]

        for t in delta_x:
            dist.all_reduce(t)
        for t in delta_c:
            dist.all_reduce(t)

        with torch.no_grad():
            for p, xs, dx in zip(model.parameters(), x_start, delta_x):
                p.copy_(xs + args.server_lr * dx)
            for cg, dc in zip(c_global, delta_c):
                cg.add_(dc.to(device), alpha=1.0 / args.num_clients)

        if rank == 0 and (rnd + 1) % args.eval_every == 0:
            acc = test(model, test_loader, device)
            log.info("round %d  acc %.4f  last local loss %.3f  (%.1fs)",
                     rnd + 1, acc, last_loss, time.time() - t0)
            os.makedirs(args.save_dir, exist_ok=True)
            torch.save({"round": rnd + 1, "model": model.state_dict(),
                        "c_global": [c.cpu() for c in c_global]},
                       os.path.join(args.save_dir, "scaffold_last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
