"""FedAdam (Reddi et al., 2021) with client sampling and central DP.

* one client per rank, Dirichlet label skew on CIFAR-10
* each round a fixed-size random cohort is drawn (same draw on every rank);
  clients outside the cohort contribute a zero update but still take part in
  the collectives
* client updates are clipped to L2 norm C; the server adds N(0, (zC)^2) to the
  sum once (drawn on rank 0) -- DP-FedAvg style central noise
* the server applies the averaged pseudo-gradient with Adam
* resumable: model, server Adam state and round counter are checkpointed

    torchrun --nproc_per_node=8 18_fedadam_central_dp_resume.py --cohort 4 --z 0.8
"""
import argparse
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


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/cifar10")
    ap.add_argument("--ckpt", default="./ckpt/fedadam_dp/state.pt")
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--cohort", type=int, default=4)
    ap.add_argument("--local_steps", type=int, default=40)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--client_lr", type=float, default=0.03)
    ap.add_argument("--server_lr", type=float, default=1e-3)
    ap.add_argument("--clip", type=float, default=2.0)
    ap.add_argument("--z", type=float, default=0.8)
    ap.add_argument("--alpha", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=21)
    ap.add_argument("--eval_every", type=int, default=10)
    return ap.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        def block(i, o):
            return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.GroupNorm(8, o), nn.ReLU(),
                                 nn.Conv2d(o, o, 3, padding=1), nn.GroupNorm(8, o), nn.ReLU(),
                                 nn.MaxPool2d(2))
        self.f = nn.Sequential(block(3, 32), block(32, 64), block(64, 128))
        self.head = nn.Linear(128 * 4 * 4, 10)

    def forward(self, x):
        return self.head(self.f(x).flatten(1))


def split_clients(targets, n, alpha, seed):
    rng = np.random.default_rng(seed)
    targets = np.asarray(targets)
    res = [[] for _ in range(n)]
    for c in range(10):
        ids = rng.permutation(np.flatnonzero(targets == c))
        p = rng.dirichlet(np.full(n, alpha))
        for k, chunk in enumerate(np.split(ids, (np.cumsum(p)[:-1] * len(ids)).astype(int))):
            res[k].extend(chunk.tolist())
    return res


def batches(loader):
    while True:
        yield from loader


def client_update(model, it, args, device):
    start = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=args.client_lr)
    model.train()
    for _ in range(args.local_steps):
        x, y = next(it)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    delta = [p.detach() - s for p, s in zip(model.parameters(), start)]
    with torch.no_grad():
        for p, s in zip(model.parameters(), start):
            p.copy_(s)  # the model goes back to the global weights
    return delta, loss.item()


@torch.no_grad()
def clip_(delta, c):
    norm = torch.sqrt(sum((d.float() ** 2).sum() for d in delta))
    factor = torch.clamp(c / (norm + 1e-12), max=1.0)
    for d in delta:
        d.mul_(factor)
    return norm.item()


@torch.no_grad()
def evaluate(model, ds, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    loader = DataLoader(Subset(ds, range(rank, len(ds), world)), batch_size=1000, num_workers=2)
    model.eval()
    s = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        s[0] += (model(x).argmax(1) == y).sum()
        s[1] += y.numel()
    dist.all_reduce(s)
    return (s[0] / s[1]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)  # client-side randomness differs per client

    norm = T.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    train = torchvision.datasets.CIFAR10(args.data, train=True, transform=T.Compose(
        [T.RandomCrop(32, 4), T.RandomHorizontalFlip(), T.ToTensor(), norm]))
    test = torchvision.datasets.CIFAR10(args.data, train=False, transform=T.Compose([T.ToTensor(), norm]))
    parts = split_clients(train.targets, world, args.alpha, args.seed)
    it = batches(DataLoader(Subset(train, parts[rank]), batch_size=args.batch_size, shuffle=True,
                            num_workers=3, pin_memory=True, drop_last=True))

    model = Net().to(device)
    server_opt = torch.optim.Adam(model.parameters(), lr=args.server_lr, betas=(0.9, 0.99), eps=1e-3)
    start_round = 0
    if os.path.isfile(args.ckpt):
        state = torch.load(args.ckpt, map_location="cpu")
        model.load_state_dict(state["model"])
        server_opt.load_state_dict(state["server_opt"])
        start_round = state["round"]
    else:
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
    noise_gen = torch.Generator(device=device)
    noise_gen.manual_seed(args.seed * 31 + start_round)

    for rnd in range(start_round, args.rounds):
        t0 = time.time()
        cohort = np.random.default_rng((args.seed, rnd)).choice(world, args.cohort, replace=False)
        if rank in cohort:
            delta, loss = client_update(model, it, args, device)
            pre_norm = clip_(delta, args.clip)
        else:
            delta, loss, pre_norm = [torch.zeros_like(p) for p in model.parameters()], 0.0, 0.0

        if rank == 0:
            for d in delta:
                d.add_(torch.randn(d.shape, generator=noise_gen, device=device), alpha=args.z * args.clip)
        for d in delta:
            dist.all_reduce(d)

        # pseudo-gradient = -mean(delta); Adam minimises, so feed it as a gradient
        server_opt.zero_grad(set_to_none=False)
        for p, d in zip(model.parameters(), delta):
            p.grad = -d / args.cohort
        server_opt.step()

        info = torch.tensor([loss, pre_norm], device=device)
        dist.all_reduce(info)
        info /= args.cohort
        if (rnd + 1) % args.eval_every == 0:
            acc = evaluate(model, test, device)
            if rank == 0:
                print(f"round {rnd + 1}: acc {acc:.4f} loss {info[0]:.4f} "
                      f"mean norm {info[1]:.3f} ({time.time() - t0:.1f}s)", flush=True)
                os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
                tmp = args.ckpt + ".tmp"
                torch.save({"round": rnd + 1, "model": model.state_dict(),
                            "server_opt": server_opt.state_dict()}, tmp)
                os.replace(tmp, args.ckpt)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
