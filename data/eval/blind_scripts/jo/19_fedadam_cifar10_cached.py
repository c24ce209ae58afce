"""FedAdam (Reddi et al., "Adaptive Federated Optimization") on CIFAR-10.

* client partition is computed once and cached on the shared filesystem
* server state = global weights + Adam moments, checkpointed by rank 0 and
  independent of the number of ranks, so a run can be resumed on a different allocation
* metrics go to Weights & Biases from rank 0 only

    torchrun --nnodes=$NNODES --nproc_per_node=4 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        19_fedadam_cifar10_cached.py --cache /shared/cache/cifar10_parts --ckpt /shared/ckpt/fedadam
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


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/shared/datasets/cifar10")
    p.add_argument("--cache", default="/shared/cache/cifar10_parts")
    p.add_argument("--ckpt", default="/shared/ckpt/fedadam")
    p.add_argument("--clients", type=int, default=500)
    p.add_argument("--alpha", type=float, default=0.3)
    p.add_argument("--per-round", type=int, default=30)
    p.add_argument("--rounds", type=int, default=1500)
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--bs", type=int, default=20)
    p.add_argument("--client-lr", type=float, default=0.03)
    p.add_argument("--server-lr", type=float, default=1e-2)
    p.add_argument("--tau", type=float, default=1e-3, help="server Adam epsilon (adaptivity)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wandb", action="store_true")
    return p.parse_args()


def make_net():
    def conv(ci, co):
        return nn.Sequential(nn.Conv2d(ci, co, 3, padding=1, bias=False), nn.GroupNorm(4, co), nn.ReLU())
    return nn.Sequential(
        conv(3, 64), conv(64, 64), nn.MaxPool2d(2),
        conv(64, 128), conv(128, 128), nn.MaxPool2d(2),
        conv(128, 256), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, 10),
    )


def dirichlet_parts(targets, n, alpha, seed):
    rng = np.random.default_rng(seed)
    t = np.asarray(targets)
    parts = [[] for _ in range(n)]
    for c in range(10):
        ids = rng.permutation(np.flatnonzero(t == c))
        cut = (np.cumsum(rng.dirichlet([alpha] * n))[:-1] * len(ids)).astype(int)
        for k, ch in enumerate(np.split(ids, cut)):
            parts[k] += ch.tolist()
    return parts


def load_or_build_parts(args, targets, rank):
    path = os.path.join(args.cache, f"dir_n{args.clients}_a{args.alpha}_s{args.seed}.pt")
    if rank == 0 and not os.path.exists(path):
        os.makedirs(args.cache, exist_ok=True)
        parts = dirichlet_parts(targets, args.clients, args.alpha, args.seed)
        tmp = f"{path}.tmp.{os.getpid()}"
        torch.save(parts, tmp)
        os.replace(tmp, path)  # atomic: readers never see a partial file
    dist.barrier()
    return torch.load(path)


def client_train(model, loader, epochs, lr, dev):
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(epochs):
        for x, y in loader:
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)

    run = None
    if args.wandb and rank == 0:
        import wandb
        run = wandb.init(project="fedadam-cifar10", config=vars(args) | {"world_size": world})

    norm = transforms.Normalize((0.4914, 0.4822, 0.4465), (0.247, 0.243, 0.261))
    train = datasets.CIFAR10(args.data, train=True, transform=transforms.Compose(
        [transforms.RandomCrop(32, 4), transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm]))
    test = datasets.CIFAR10(args.data, train=False, transform=transforms.Compose([transforms.ToTensor(), norm]))
    parts = load_or_build_parts(args, train.targets, rank)
    test_loader = DataLoader(Subset(test, range(rank, len(test), world)), batch_size=500, num_workers=4)

    server = make_net().to(dev)
    client = make_net().to(dev)
    for t in server.state_dict().values():
        dist.broadcast(t, 0)
    server_opt = torch.optim.Adam(server.parameters(), lr=args.server_lr, betas=(0.9, 0.99), eps=args.tau)

    start = 0
    ckpt_file = os.path.join(args.ckpt, "server.pt")
    if os.path.exists(ckpt_file):
        ck = torch.load(ckpt_file, map_location=dev)
        server.load_state_dict(ck["model"])
        server_opt.load_state_dict(ck["opt"])
        start = ck["round"]
        del ck

    for rnd in range(start, args.rounds):
        t0 = time.time()
        chosen = np.random.default_rng([args.seed, rnd]).choice(args.clients, args.per_round, replace=False)
        delta = [torch.zeros_like(p) for p in server.parameters()]
        wsum = torch.zeros(1, device=dev)
        for cid in chosen[rank::world]:
            if not parts[cid]:
                continue
            client.load_state_dict(server.state_dict())
            loader = DataLoader(Subset(train, parts[cid]), batch_size=args.bs, shuffle=True,
                                num_workers=2, pin_memory=True)
            client_train(client, loader, args.local_epochs, args.client_lr, dev)
            for d, ps, pc in zip(delta, server.parameters(), client.parameters()):
                d.add_(ps.detach() - pc.detach(), alpha=len(parts[cid]))
            wsum += len(parts[cid])

        packed = torch.cat([d.flatten() for d in delta] + [wsum])
        dist.all_reduce(packed)
        total = packed[-1]
        server_opt.zero_grad(set_to_none=True)
        off = 0
        for p in server.parameters():
            k = p.numel()
            p.grad = (packed[off:off + k] / total).view_as(p)
            off += k
        server_opt.step()

        if (rnd + 1) % 25 == 0:
            server.eval()
            s = torch.zeros(2, device=dev)
            with torch.no_grad():
                for x, y in test_loader:
                    x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
                    s[0] += (server(x).argmax(1) == y).sum()
                    s[1] += y.numel()
            dist.all_reduce(s)
            acc = (s[0] / s[1]).item()
            if rank == 0:
                print(f"round {rnd + 1} acc {acc:.4f} ({time.time() - t0:.1f}s)", flush=True)
                if run is not None:
                    run.log({"round": rnd + 1, "test/acc": acc})
                os.makedirs(args.ckpt, exist_ok=True)
                torch.save({"model": server.state_dict(), "opt": server_opt.state_dict(), "round": rnd + 1},
                           ckpt_file + ".tmp")
                os.replace(ckpt_file + ".tmp", ckpt_file)
            dist.barrier()

    if run is not None:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
