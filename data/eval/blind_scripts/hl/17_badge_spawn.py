"""BADGE active learning on CIFAR-10, one process per GPU started with mp.spawn.

    python 17_badge_spawn.py --gpus 4 --rounds 10 --out runs/badge_spawn
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
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets, transforms
from torchvision.models import resnet18

NORM = transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--data", default="./data")
    ap.add_argument("--out", default="runs/badge_spawn")
    ap.add_argument("--init_size", type=int, default=1000)
    ap.add_argument("--budget", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--candidates", type=int, default=10000)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--batch_per_gpu", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--port", type=int, default=29512)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        r = resnet18(num_classes=10)
        r.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        r.maxpool = nn.Identity()
        self.head = r.fc
        r.fc = nn.Identity()
        self.body = r

    def forward(self, x):
        return self.head(self.body(x))

    def embed(self, x):
        h = self.body(x)
        return self.head(h), h


@torch.no_grad()
def grad_embeddings(net, dataset, cand, device, rank, world):
    sub = Subset(dataset, cand)
    sampler = DistributedSampler(sub, num_replicas=world, rank=rank, shuffle=False)
    loader = DataLoader(sub, batch_size=500, sampler=sampler, num_workers=4, pin_memory=True)
    net.eval()
    parts = []
    for x, _ in loader:
        logits, h = net.embed(x.to(device, non_blocking=True))
        p = logits.softmax(1)
        g = p - F.one_hot(p.argmax(1), 10).float()
        parts.append((g.unsqueeze(2) * h.unsqueeze(1)).flatten(1).half())  # half: 10x512 per sample
    emb = torch.cat(parts)
    pos = torch.tensor(list(sampler), device=device)
    embs = [torch.empty_like(emb) for _ in range(world)]
    poss = [torch.empty_like(pos) for _ in range(world)]
    dist.all_gather(embs, emb)
    dist.all_gather(poss, pos)
    full = torch.empty(len(cand), emb.size(1), device=device, dtype=emb.dtype)
    full[torch.cat(poss)] = torch.cat(embs)
    return full.float()


def kmeanspp(X, k, seed):
    rng = np.random.default_rng(seed)
    idx = [int(torch.argmax(X.norm(dim=1)))]
    d2 = ((X - X[idx[0]]) ** 2).sum(1)
    while len(idx) < k:
        p = (d2 / d2.sum()).cpu().double().numpy()
        j = int(rng.choice(len(p), p=p / p.sum()))
        idx.append(j)
        d2 = torch.minimum(d2, ((X - X[j]) ** 2).sum(1))
        d2[j] = 0
    return idx


def run(rank, world, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world)
    device = torch.device("cuda", rank)

    train_set = datasets.CIFAR10(args.data, train=True, transform=transforms.Compose(
        [transforms.RandomCrop(32, 4), transforms.RandomHorizontalFlip(), transforms.ToTensor(), NORM]))
    plain_set = datasets.CIFAR10(args.data, train=True, transform=transforms.Compose([transforms.ToTensor(), NORM]))
    test_set = datasets.CIFAR10(args.data, train=False, transform=transforms.Compose([transforms.ToTensor(), NORM]))

    rng = np.random.default_rng(args.seed)  # identical stream on every rank
    labelled = rng.choice(len(train_set), args.init_size, replace=False).tolist()
    start = 0
    if args.resume:
        blob = torch.load(os.path.join(args.out, "al_state.pt"), map_location=device)
        labelled, start = blob["labelled"], blob["round"] + 1
        rng.bit_generator.state = blob["rng"]

    for rnd in range(start, args.rounds + 1):
        t0 = time.time()
        net = nn.SyncBatchNorm.convert_sync_batchnorm(Net()).to(device)
        model = DDP(net, device_ids=[rank])
        sub = Subset(train_set, labelled)
        sampler = DistributedSampler(sub, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
        loader = DataLoader(sub, batch_size=args.batch_per_gpu, sampler=sampler, num_workers=4,
                            pin_memory=True, drop_last=True)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr * world * args.batch_per_gpu / 128,
                              momentum=0.9, weight_decay=5e-4)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs)
        for ep in range(args.epochs):
            sampler.set_epoch(ep)
            model.train()
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            sched.step()

        # test accuracy
        ts = DistributedSampler(test_set, num_replicas=world, rank=rank, shuffle=False)
        tl = DataLoader(test_set, batch_size=1000, sampler=ts, num_workers=4)
        net.eval()
        hits = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in tl:
                y = y.to(device)
                hits += torch.stack([(net(x.to(device)).argmax(1) == y).sum().float(),
                                     torch.tensor(float(y.numel()), device=device)])
        dist.all_reduce(hits)
        acc = (hits[0] / hits[1]).item()

        # wall time per rank, for spotting stragglers
        times = [None] * world
        dist.all_gather_object(times, round(time.time() - t0, 1))
        if rank == 0:
            print(f"round {rnd} | n={len(labelled)} | acc={acc:.4f} | rank times {times}", flush=True)
            torch.save({"model": net.state_dict(), "labelled": labelled, "round": rnd},
                       os.path.join(args.out, f"round{rnd:02d}.pt"))
            with open(os.path.join(args.out, "curve.jsonl"), "a") as f:
                f.write(json.dumps({"round": rnd, "n": len(labelled), "acc": acc}) + "\n")
        if rnd == args.rounds:
            break

        lab = set(labelled)
        pool = np.array([i for i in range(len(train_set)) if i not in lab])
        cand = rng.choice(pool, min(args.candidates, len(pool)), replace=False).tolist()
        X = grad_embeddings(model.module, plain_set, cand, device, rank, world)
        chosen = [None]
        if rank == 0:
            chosen = [[cand[j] for j in kmeanspp(X, args.budget, args.seed + rnd)]]
        dist.broadcast_object_list(chosen, src=0)
        labelled = labelled + chosen[0]
        if rank == 0:
            torch.save({"labelled": labelled, "round": rnd, "rng": rng.bit_generator.state},
                       os.path.join(args.out, "al_state.pt"))

    dist.destroy_process_group()


def main():
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    # download once in the parent, before any worker starts
    datasets.CIFAR10(args.data, train=True, download=True)
    datasets.CIFAR10(args.data, train=False, download=True)
    mp.spawn(run, args=(args.gpus, args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
