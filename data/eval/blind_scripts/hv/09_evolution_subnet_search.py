"""Evolutionary search over sub-networks of a trained one-shot supernet.

Rank 0 runs the evolution (mutation / crossover / selection); each candidate
is sent to all ranks, its BatchNorm statistics are recalibrated, and it is
scored on the validation split with the work shared across GPUs.

    torchrun --nproc_per_node=8 09_evolution_subnet_search.py \
        --supernet ckpt/supernet_ep120.pt --data /datasets/imagenet --flops-limit 330
"""
import argparse
import json
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

KERNELS = [3, 5, 7]
EXPANDS = [3, 4, 6]
STAGES = [(40, 4, 2), (80, 4, 2), (160, 4, 2), (320, 4, 2)]


class DynamicMBConv(nn.Module):
    def __init__(self, cin, cout, stride, max_expand=max(EXPANDS)):
        super().__init__()
        self.mid = cin * max_expand
        self.cin = cin
        self.pw = nn.Sequential(nn.Conv2d(cin, self.mid, 1, bias=False), nn.BatchNorm2d(self.mid), nn.ReLU6(inplace=True))
        self.dw = nn.ModuleList(nn.Sequential(nn.Conv2d(self.mid, self.mid, k, stride, k // 2, groups=self.mid, bias=False),
                                              nn.BatchNorm2d(self.mid), nn.ReLU6(inplace=True)) for k in KERNELS)
        self.pwl = nn.Sequential(nn.Conv2d(self.mid, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.res = stride == 1 and cin == cout

    def forward(self, x, kernel_idx, expand):
        h = self.pw(x)
        active = self.cin * expand
        if active < self.mid:
            mask = torch.zeros(1, self.mid, 1, 1, device=h.device, dtype=h.dtype)
            mask[:, :active] = 1
            h = h * mask
        h = self.pwl(self.dw[kernel_idx](h))
        return x + h if self.res else h


class OneShotNet(nn.Module):
    def __init__(self, num_classes=1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 24, 3, 2, 1, bias=False), nn.BatchNorm2d(24), nn.ReLU6(inplace=True))
        blocks, c = [], 24
        for cout, n, s in STAGES:
            for i in range(n):
                blocks.append(DynamicMBConv(c, cout, s if i == 0 else 1))
                c = cout
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Sequential(nn.Conv2d(c, 1280, 1, bias=False), nn.BatchNorm2d(1280), nn.ReLU6(inplace=True))
        self.fc = nn.Linear(1280, num_classes)

    @property
    def num_layers(self):
        return len(self.blocks)

    def forward(self, x, cand):
        L = self.num_layers
        ks, es = cand[:L], cand[L:]
        x = self.stem(x)
        for blk, k, e in zip(self.blocks, ks, es):
            x = blk(x, k, EXPANDS[e])
        return self.fc(F.adaptive_avg_pool2d(self.head(x), 1).flatten(1))


def flops_m(cand, L, res=224):
    """Rough MAdds estimate (millions) of a candidate."""
    total, hw, c = 0.0, res // 2, 24
    total += 3 * 24 * 9 * hw * hw
    i = 0
    for cout, n, s in STAGES:
        for j in range(n):
            mid = c * EXPANDS[cand[L + i]]
            k = KERNELS[cand[i]]
            hw_out = hw // (s if j == 0 else 1)
            total += c * mid * hw * hw + mid * k * k * hw_out * hw_out + mid * cout * hw_out * hw_out
            hw, c, i = hw_out, cout, i + 1
    total += c * 1280 * hw * hw + 1280 * 1000
    return total / 1e6


def sync_candidate(cand, num_layers, device):
    if dist.get_rank() == 0:
        buf = torch.tensor(cand, dtype=torch.long, device=device)
    else:
        buf = torch.empty(num_layers, dtype=torch.long, device=device)
    dist.broadcast(buf, src=0)
    return buf.tolist()


@torch.no_grad()
def recalibrate_bn(model, cand, loader, batches, device):
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.reset_running_stats()
            m.momentum = None  # cumulative average
    model.train()
    for i, (x, _) in enumerate(loader):
        if i >= batches:
            break
        model(x.to(device, non_blocking=True), cand)
    # average the statistics so every rank scores the same network
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            dist.all_reduce(m.running_mean)
            dist.all_reduce(m.running_var)
            m.running_mean /= dist.get_world_size()
            m.running_var /= dist.get_world_size()


@torch.no_grad()
def score(model, cand, loader, device):
    model.eval()
    t = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            t[0] += (model(x, cand).argmax(1) == y).sum()
        t[1] += y.numel()
    dist.all_reduce(t)
    return (t[0] / t[1]).item()


def random_cand(rng, L, limit):
    while True:
        c = [rng.randrange(len(KERNELS)) for _ in range(L)] + [rng.randrange(len(EXPANDS)) for _ in range(L)]
        if flops_m(c, L) <= limit:
            return c


def mutate(rng, parent, L, p, limit):
    for _ in range(100):
        c = [rng.randrange(len(KERNELS)) if rng.random() < p else g for g in parent[:L]]
        c += [rng.randrange(len(EXPANDS)) if rng.random() < p else g for g in parent[L:]]
        if flops_m(c, L) <= limit:
            return c
    return list(parent)


def crossover(rng, a, b, L, limit):
    for _ in range(100):
        c = [rng.choice(pair) for pair in zip(a, b)]
        if flops_m(c, L) <= limit:
            return c
    return list(a)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--supernet", required=True)
    ap.add_argument("--data", default="/datasets/imagenet")
    ap.add_argument("--out", default="search/evo")
    ap.add_argument("--flops-limit", type=float, default=330.0)
    ap.add_argument("--population", type=int, default=50)
    ap.add_argument("--generations", type=int, default=20)
    ap.add_argument("--topk", type=int, default=10)
    ap.add_argument("--mutation-prob", type=float, default=0.1)
    ap.add_argument("--calib-batches", type=int, default=20)
    ap.add_argument("--val-images", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    calib_set = datasets.ImageFolder(os.path.join(args.data, "train"), transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm]))
    val_full = datasets.ImageFolder(os.path.join(args.data, "val"), transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm]))
    pick = torch.randperm(len(val_full), generator=torch.Generator().manual_seed(args.seed))[: args.val_images]
    val_set = Subset(val_full, pick[rank::world].tolist())
    # the epoch is never advanced: every candidate is calibrated on the same images
    calib_loader = DataLoader(calib_set, 64, sampler=DistributedSampler(calib_set, shuffle=True, seed=args.seed),
                              num_workers=8, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, 200, num_workers=8, pin_memory=True)

    model = OneShotNet().to(device)
    ckpt = torch.load(args.supernet, map_location=device)
    model.load_state_dict(ckpt["model"])
    L = model.num_layers

    rng = random.Random(args.seed)
    cache = {}

    def evaluate(cand):
        cand = sync_candidate(cand, L, device)
        key = tuple(cand)
        if key not in cache:
            recalibrate_bn(model, cand, calib_loader, args.calib_batches, device)
            cache[key] = score(model, cand, val_loader, device)
        return cache[key]

    population = []
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for gen in range(args.generations):
        t0 = time.time()
        if gen == 0:
            children = [random_cand(rng, L, args.flops_limit) for _ in range(args.population)]
        else:
            parents = [c for c, _ in population[: args.topk]]
            n_mut = args.population // 2
            children = [mutate(rng, rng.choice(parents), L, args.mutation_prob, args.flops_limit) for _ in range(n_mut)]
            children += [crossover(rng, *rng.sample(parents, 2), L, args.flops_limit)
                         for _ in range(args.population - n_mut)]
        scored = [(c, evaluate(c)) for c in children]
        population = sorted(population + scored, key=lambda t: -t[1])[: args.population]
        if rank == 0:
            best_c, best_a = population[0]
            print(f"gen {gen}: best top-1 {best_a:.4f} flops {flops_m(best_c, L):.0f}M ({time.time() - t0:.0f}s)", flush=True)
            with open(os.path.join(args.out, f"gen_{gen:02d}.json"), "w") as f:
                json.dump([{"cand": c, "acc": a, "flops": flops_m(c, L)} for c, a in population], f)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
