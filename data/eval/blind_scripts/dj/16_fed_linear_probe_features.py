"""Federated linear probing on frozen ImageNet features (CIFAR-100).

A frozen torchvision ResNet-50 turns CIFAR-100 into 2048-d features once; the
features are cached on disk so that later runs (different alpha / lr / number
of clients) start immediately. The federated part trains a 2-layer head with
FedAvg over Dirichlet non-IID clients, with a random subset of clients taking
part in each round.

    torchrun --nproc_per_node=8 16_fed_linear_probe_features.py --alpha 0.05 --frac 0.5
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
from torch.utils.data import DataLoader, TensorDataset
from torchvision.models import ResNet50_Weights, resnet50


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_root", default="/datasets/cifar100")
    ap.add_argument("--cache_dir", default="/datasets/cache/cifar100_r50_feats")
    ap.add_argument("--out_dir", default="./exp/fed_probe")
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--local_epochs", type=int, default=5)
    ap.add_argument("--batch_size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--frac", type=float, default=0.5, help="fraction of clients per round")
    ap.add_argument("--alpha", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=1234)
    return ap.parse_args()


@torch.no_grad()
def extract(backbone, dataset, device, bs=256):
    loader = DataLoader(dataset, batch_size=bs, shuffle=False, num_workers=8, pin_memory=True)
    feats, labels = [], []
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            f = backbone(x.to(device, non_blocking=True))
        feats.append(f.float().cpu())
        labels.append(y)
    return torch.cat(feats), torch.cat(labels)


def get_features(args, device):
    os.makedirs(args.cache_dir, exist_ok=True)
    path = os.path.join(args.cache_dir, "features.pt")
    if os.path.exists(path):
        return torch.load(path, map_location="cpu")
    weights = ResNet50_Weights.IMAGENET1K_V2
    backbone = resnet50(weights=weights)
    backbone.fc = nn.Identity()
    backbone.eval().to(device)
    tf = weights.transforms()
    train = torchvision.datasets.CIFAR100(args.data_root, train=True, transform=tf)
    test = torchvision.datasets.CIFAR100(args.data_root, train=False, transform=tf)
    xtr, ytr = extract(backbone, train, device)
    xte, yte = extract(backbone, test, device)
    cache = {"train": (xtr, ytr), "test": (xte, yte)}
    torch.save(cache, path)
    del backbone
    torch.cuda.empty_cache()
    return cache


def dirichlet(labels, n, alpha, seed):
    rng = np.random.default_rng(seed)
    idx = [[] for _ in range(n)]
    for c in np.unique(labels):
        ids = rng.permutation(np.flatnonzero(labels == c))
        q = rng.dirichlet(np.full(n, alpha))
        for k, chunk in enumerate(np.split(ids, (np.cumsum(q)[:-1] * len(ids)).astype(int))):
            idx[k].extend(chunk.tolist())
    return idx


class ProbeHead(nn.Module):
    def __init__(self, dim=2048, hidden=512, classes=100):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Dropout(0.1),
                                 nn.Linear(hidden, classes))

    def forward(self, x):
        return self.net(x)


def train_head(model, loader, args, device):
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    for _ in range(args.local_epochs):
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()


@torch.no_grad()
def aggregate(model, weight, device):
    """Weighted mean; non-participating clients call this with weight 0."""
    w = torch.tensor([weight], device=device)
    w_sum = w.clone()
    dist.all_reduce(w_sum)
    for p in model.parameters():
        p.mul_(w / w_sum)
        dist.all_reduce(p)


@torch.no_grad()
def evaluate(model, x, y, device):
    model.eval()
    pred = torch.cat([model(xb.to(device)).argmax(1).cpu() for xb in x.split(4096)])
    return (pred == y).float().mean().item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    # pretrained weights and the dataset are fetched once, by rank 0
    if rank == 0:
        resnet50(weights=ResNet50_Weights.IMAGENET1K_V2)
        torchvision.datasets.CIFAR100(args.data_root, train=True, download=True)
        torchvision.datasets.CIFAR100(args.data_root, train=False, download=True)
    dist.barrier()

    cache = get_features(args, device)
    xtr, ytr = cache["train"]
    xte, yte = cache["test"]
    parts = dirichlet(ytr.numpy(), world, args.alpha, args.seed)
    mine = torch.tensor(parts[rank], dtype=torch.long)
    loader = DataLoader(TensorDataset(xtr[mine], ytr[mine]), batch_size=args.batch_size,
                        shuffle=True)

    head = ProbeHead().to(device)
    for p in head.parameters():
        dist.broadcast(p.data, src=0)

    n_part = max(1, int(round(args.frac * world)))
    history = []
    for rnd in range(args.rounds):
        t0 = time.time()
        chosen = np.random.default_rng(args.seed + rnd).choice(world, n_part, replace=False)
        participating = rank in chosen and len(mine) > 0
        if participating:
            train_head(head, loader, args, device)
        aggregate(head, float(len(mine)) if participating else 0.0, device)

        if rank == 0:
            acc = evaluate(head, xte, yte, device)
            history.append(acc)
            print(f"round {rnd:3d} clients {sorted(chosen.tolist())} test acc {acc:.4f} "
                  f"({time.time() - t0:.2f}s)", flush=True)
        dist.barrier()

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        torch.save({"head": head.state_dict(), "acc_history": history},
                   os.path.join(args.out_dir, f"probe_a{args.alpha}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
