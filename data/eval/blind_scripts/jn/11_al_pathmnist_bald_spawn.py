"""Deep Bayesian active learning (BALD, MC dropout) on PathMNIST.

Started on one node with mp.spawn (no torchrun on this cluster's login image):

    python 11_al_pathmnist_bald_spawn.py --root /data/medmnist --gpus 4 --out /shared/al/pathmnist_bald
"""
import argparse
import json
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from medmnist import PathMNIST
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms


def get_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/medmnist")
    ap.add_argument("--out", required=True)
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--port", type=int, default=29531)
    ap.add_argument("--init", type=int, default=450)
    ap.add_argument("--acquire", type=int, default=450)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch", type=int, default=64, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--mc-samples", type=int, default=20)
    ap.add_argument("--pool-subset", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=5)
    return ap.parse_args()


class MedMNISTWrap(Dataset):
    """medmnist returns labels of shape (1,); flatten them and add the index."""

    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        return x, int(y[0]), i


class ConvNet(nn.Module):
    def __init__(self, n_classes=9, p=0.5):
        super().__init__()

        def block(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                                 nn.ReLU(inplace=True), nn.Conv2d(cout, cout, 3, padding=1, bias=False),
                                 nn.BatchNorm2d(cout), nn.ReLU(inplace=True), nn.MaxPool2d(2))

        self.body = nn.Sequential(block(3, 64), block(64, 128), block(128, 256))
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(p), nn.Linear(256 * 3 * 3, 256),
                                  nn.ReLU(inplace=True), nn.Dropout(p), nn.Linear(256, n_classes))

    def forward(self, x):
        return self.head(self.body(x))


def mc_dropout_mode(net):
    net.eval()  # BatchNorm uses running statistics
    for m in net.modules():
        if isinstance(m, nn.Dropout):
            m.train()


@torch.no_grad()
def bald(net, ds, idx, device, T):
    sub = Subset(ds, idx.tolist())
    loader = DataLoader(sub, batch_size=512, sampler=DistributedSampler(sub, shuffle=False),
                        num_workers=4, pin_memory=True)
    mc_dropout_mode(net)
    scores, ids = [], []
    for x, _, i in loader:
        x = x.to(device, non_blocking=True)
        p = torch.stack([F.softmax(net(x), 1) for _ in range(T)])
        pm = p.mean(0)
        ent = -(pm * pm.clamp_min(1e-12).log()).sum(1)
        exp_ent = -(p * p.clamp_min(1e-12).log()).sum(2).mean(0)
        scores.append((ent - exp_ent).cpu())
        ids.append(i)
    local = dict(zip(torch.cat(ids).tolist(), torch.cat(scores).tolist()))
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    merged = {}
    for d in parts:
        merged.update(d)  # padded duplicates collapse onto the same key
    return merged


@torch.no_grad()
def evaluate(net, ds, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    sub = Subset(ds, list(range(rank, len(ds), world)))
    net.eval()
    stats = torch.zeros(2, device=device)
    for x, y, _ in DataLoader(sub, batch_size=1024, num_workers=4):
        y = y.to(device)
        stats[0] += (net(x.to(device)).argmax(1) == y).sum()
        stats[1] += len(y)
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item()


def main_worker(rank, world_size, cfg):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{cfg.port}",
                            rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)

    norm = transforms.Normalize([0.5] * 3, [0.5] * 3)
    aug = transforms.Compose([transforms.RandomHorizontalFlip(), transforms.RandomVerticalFlip(),
                              transforms.ToTensor(), norm])
    plain = transforms.Compose([transforms.ToTensor(), norm])
    train_ds = MedMNISTWrap(PathMNIST(split="train", root=cfg.root, transform=aug))
    pool_ds = MedMNISTWrap(PathMNIST(split="train", root=cfg.root, transform=plain))
    test_ds = MedMNISTWrap(PathMNIST(split="test", root=cfg.root, transform=plain))

    rng = np.random.default_rng(cfg.seed)  # identical on every rank
    labelled = np.sort(rng.choice(len(train_ds), cfg.init, replace=False))
    log = []
    for rnd in range(cfg.rounds):
        t0 = time.time()
        torch.manual_seed(cfg.seed + rnd)
        random.seed(cfg.seed + rnd)
        model = DDP(ConvNet().to(device), device_ids=[rank])
        sub = Subset(train_ds, labelled.tolist())
        sampler = DistributedSampler(sub, shuffle=True, seed=cfg.seed + rnd, drop_last=True)
        loader = DataLoader(sub, batch_size=cfg.batch, sampler=sampler, num_workers=4, drop_last=True)
        opt = torch.optim.Adam(model.parameters(), lr=cfg.lr * world_size)
        for ep in range(cfg.epochs):
            sampler.set_epoch(ep)
            model.train()
            for x, y, _ in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()

        acc = evaluate(model.module, test_ds, device)

        # score a random subset of the pool (same subset on every rank)
        unlabelled = np.setdiff1d(np.arange(len(train_ds)), labelled)
        cand = rng.choice(unlabelled, size=min(cfg.pool_subset, len(unlabelled)), replace=False)
        scores = bald(model.module, pool_ds, cand, device, cfg.mc_samples)
        ranked = sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))
        new = np.array([i for i, _ in ranked[: cfg.acquire]], dtype=np.int64)
        labelled = np.union1d(labelled, new)

        log.append({"round": rnd, "n_labelled": int(len(sub)), "test_acc": acc,
                    "mean_bald": float(np.mean(list(scores.values()))), "sec": time.time() - t0})
        if rank == 0:
            os.makedirs(cfg.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "labelled": labelled.tolist()},
                       os.path.join(cfg.out, f"round{rnd:02d}.pt"))
            with open(os.path.join(cfg.out, "log.json"), "w") as f:
                json.dump(log, f, indent=1)
            print(log[-1], flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    cfg = get_config()
    mp.spawn(main_worker, args=(cfg.gpus, cfg), nprocs=cfg.gpus, join=True)
