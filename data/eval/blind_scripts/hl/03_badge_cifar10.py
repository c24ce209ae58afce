"""BADGE (Ash et al., 2020) active learning on CIFAR-10 with DistributedDataParallel.

Gradient embeddings g(x) = (p - onehot(argmax p)) (x) h(x) of the pool are computed
on all ranks, gathered, and k-means++ seeding on rank 0 picks the next batch.

    torchrun --nproc_per_node=4 03_badge_cifar10.py --config configs/badge_c10.json
"""
import argparse
import json
import os
import time
from dataclasses import dataclass, asdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets, transforms


@dataclass
class Config:
    data_dir: str = "./data"
    out_dir: str = "./runs/badge"
    init_size: int = 100
    budget: int = 100
    rounds: int = 20
    epochs: int = 60
    global_batch: int = 64
    lr: float = 1e-3
    pool_subsample: int = 20000
    seed: int = 0


class ConvNet(nn.Module):
    def __init__(self, num_classes=10, width=64, emb_dim=128):
        super().__init__()

        def block(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(8, cout), nn.ReLU(inplace=True),
                                 nn.Conv2d(cout, cout, 3, padding=1), nn.GroupNorm(8, cout), nn.ReLU(inplace=True),
                                 nn.MaxPool2d(2))

        self.features = nn.Sequential(block(3, width), block(width, 2 * width), block(2 * width, 4 * width))
        self.emb = nn.Sequential(nn.Flatten(), nn.Linear(4 * width * 16, emb_dim), nn.ReLU(inplace=True))
        self.head = nn.Linear(emb_dim, num_classes)
        self.emb_dim = emb_dim

    def forward_with_embedding(self, x):
        h = self.emb(self.features(x))
        return self.head(h), h

    def forward(self, x):
        return self.forward_with_embedding(x)[0]


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ns = ap.parse_args()
    cfg = Config()
    if ns.config:
        with open(ns.config) as f:
            for k, v in json.load(f).items():
                setattr(cfg, k, v)
    return cfg


@torch.no_grad()
def gradient_embeddings(model, dataset, idx, device, rank, world_size):
    sub = Subset(dataset, idx)
    sampler = DistributedSampler(sub, num_replicas=world_size, rank=rank, shuffle=False)
    loader = DataLoader(sub, batch_size=500, sampler=sampler, num_workers=4, pin_memory=True)
    model.eval()
    chunks = []
    for x, _ in loader:
        logits, h = model.forward_with_embedding(x.to(device, non_blocking=True))
        p = F.softmax(logits, dim=1)
        onehot = F.one_hot(p.argmax(1), p.size(1)).float()
        g = (p - onehot).unsqueeze(2) * h.unsqueeze(1)  # [B, C, D]
        chunks.append(g.flatten(1))
    emb = torch.cat(chunks)
    pos = torch.tensor(list(iter(sampler)), device=device)  # positions into `idx`
    gathered = [torch.empty_like(emb) for _ in range(world_size)]
    gathered_pos = [torch.empty_like(pos) for _ in range(world_size)]
    dist.all_gather(gathered, emb)
    dist.all_gather(gathered_pos, pos)
    out = torch.empty(len(idx), emb.size(1), device=device)
    out[torch.cat(gathered_pos)] = torch.cat(gathered)
    return out


def kmeans_pp(emb, k, rng):
    """k-means++ seeding on the gradient embeddings (rows of `emb`)."""
    first = int(torch.argmax(emb.norm(dim=1)))
    chosen = [first]
    d2 = ((emb - emb[first]) ** 2).sum(1)
    while len(chosen) < k:
        probs = (d2 / d2.sum()).double().cpu().numpy()
        nxt = int(rng.choice(len(probs), p=probs))
        if nxt in chosen:
            continue
        chosen.append(nxt)
        d2 = torch.minimum(d2, ((emb - emb[nxt]) ** 2).sum(1))
    return chosen


def train_round(model, train_set, labelled, cfg, device, rank, world_size):
    ds = Subset(train_set, labelled)
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg.seed)
    loader = DataLoader(ds, batch_size=max(1, cfg.global_batch // world_size), sampler=sampler,
                        num_workers=4, pin_memory=True)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    model.train()
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()


@torch.no_grad()
def evaluate(model, test_set, device, rank, world_size):
    sampler = DistributedSampler(test_set, num_replicas=world_size, rank=rank, shuffle=False)
    loader = DataLoader(test_set, batch_size=1000, sampler=sampler, num_workers=4)
    model.eval()
    c = torch.zeros(2, device=device)
    for x, y in loader:
        y = y.to(device)
        c[0] += (model(x.to(device)).argmax(1) == y).sum()
        c[1] += y.numel()
    dist.all_reduce(c)
    return (c[0] / c[1]).item()


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    tf_train = transforms.Compose([transforms.RandomHorizontalFlip(), transforms.RandomCrop(32, 4),
                                   transforms.ToTensor(), transforms.Normalize((0.5,) * 3, (0.5,) * 3)])
    tf_test = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.5,) * 3, (0.5,) * 3)])
    if rank == 0:
        datasets.CIFAR10(cfg.data_dir, train=True, download=True)
        datasets.CIFAR10(cfg.data_dir, train=False, download=True)
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
            json.dump(asdict(cfg), f, indent=2)
    dist.barrier()
    train_set = datasets.CIFAR10(cfg.data_dir, train=True, transform=tf_train)
    score_set = datasets.CIFAR10(cfg.data_dir, train=True, transform=tf_test)
    test_set = datasets.CIFAR10(cfg.data_dir, train=False, transform=tf_test)

    rng = np.random.RandomState(cfg.seed)  # identical on all ranks
    n = len(train_set)
    labelled = rng.choice(n, cfg.init_size, replace=False).tolist()

    for rnd in range(cfg.rounds):
        t0 = time.time()
        torch.manual_seed(cfg.seed + rnd)
        model = DDP(ConvNet().to(device), device_ids=[local_rank])
        train_round(model, train_set, labelled, cfg, device, rank, world_size)
        acc = evaluate(model, test_set, device, rank, world_size)
        if rank == 0:
            print(f"round {rnd:2d}  n={len(labelled):5d}  acc={acc:.4f}  t={time.time() - t0:.0f}s", flush=True)
            with open(os.path.join(cfg.out_dir, "curve.csv"), "a") as f:
                f.write(f"{rnd},{len(labelled)},{acc:.5f}\n")
            torch.save({"round": rnd, "state_dict": model.module.state_dict(), "labelled": labelled},
                       os.path.join(cfg.out_dir, "latest.pt"))

        # candidates: random subsample of the unlabelled pool, same on every rank
        lab = set(labelled)
        pool = np.array([i for i in range(n) if i not in lab])
        cand = rng.choice(pool, min(cfg.pool_subsample, len(pool)), replace=False).tolist()
        emb = gradient_embeddings(model, score_set, cand, device, rank, world_size)

        picked = [None]
        if rank == 0:
            pos = kmeans_pp(emb, cfg.budget, np.random.RandomState(cfg.seed + rnd))
            picked = [[cand[p] for p in pos]]
        dist.broadcast_object_list(picked, src=0)
        labelled = labelled + picked[0]
        del emb

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
