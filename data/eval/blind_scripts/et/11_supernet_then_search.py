"""Two-stage one-shot NAS on a NAS-Bench-201-style cell space (CIFAR-10).

Stage 1 trains the weight-sharing supernet with uniform path sampling.
Stage 2 loads the trained weights into a fresh supernet and ranks random
architectures by their one-shot validation accuracy.

    torchrun --nproc_per_node=4 11_supernet_then_search.py --data ./data --workdir work/nb201
    torchrun --nproc_per_node=4 11_supernet_then_search.py --data ./data --workdir work/nb201 --search-only
"""
import argparse
import itertools
import json
import os
import random

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

OPS = ("none", "skip_connect", "nor_conv_1x1", "nor_conv_3x3", "avg_pool_3x3")
EDGES = [(1, 0), (2, 0), (2, 1), (3, 0), (3, 1), (3, 2)]


def build_op(name, c):
    if name == "none":
        return None
    if name == "skip_connect":
        return nn.Identity()
    if name == "avg_pool_3x3":
        return nn.AvgPool2d(3, 1, 1, count_include_pad=False)
    k = 1 if name == "nor_conv_1x1" else 3
    return nn.Sequential(nn.ReLU(inplace=False), nn.Conv2d(c, c, k, 1, k // 2, bias=False), nn.BatchNorm2d(c))


class SearchCell(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.edges = nn.ModuleDict()
        for (j, i) in EDGES:
            self.edges[f"{j}<-{i}"] = nn.ModuleDict(
                {o: build_op(o, c) for o in OPS if o != "none"})

    def forward(self, x, arch):
        nodes = [x]
        for j in range(1, 4):
            acc = 0
            for i in range(j):
                op = arch[EDGES.index((j, i))]
                if op == "none":
                    continue
                acc = acc + self.edges[f"{j}<-{i}"][op](nodes[i])
            nodes.append(acc if torch.is_tensor(acc) else torch.zeros_like(x))
        return nodes[-1]


class ResBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.a = nn.Sequential(nn.ReLU(), nn.Conv2d(cin, cout, 3, 2, 1, bias=False), nn.BatchNorm2d(cout))
        self.b = nn.Sequential(nn.ReLU(), nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
        self.short = nn.Sequential(nn.AvgPool2d(2), nn.Conv2d(cin, cout, 1, bias=False))

    def forward(self, x):
        return self.b(self.a(x)) + self.short(x)


class NB201SuperNet(nn.Module):
    def __init__(self, c=16, n=5, num_classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c))
        layers = []
        for stage, ch in enumerate((c, 2 * c, 4 * c)):
            if stage > 0:
                layers.append(ResBlock(ch // 2, ch))
            layers += [SearchCell(ch) for _ in range(n)]
        self.layers = nn.ModuleList(layers)
        self.last = nn.Sequential(nn.BatchNorm2d(4 * c), nn.ReLU())
        self.classifier = nn.Linear(4 * c, num_classes)

    def forward(self, x, arch):
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x, arch) if isinstance(layer, SearchCell) else layer(x)
        x = self.last(x)
        return self.classifier(F.adaptive_avg_pool2d(x, 1).flatten(1))


def random_arch(rng):
    return tuple(rng.choice(OPS) for _ in EDGES)


def get_data(root, rank, world, seed):
    mean, std = [0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616]
    train_tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(mean, std)])
    test_tf = T.Compose([T.ToTensor(), T.Normalize(mean, std)])
    full = torchvision.datasets.CIFAR10(root, train=True, transform=train_tf)
    full_eval = torchvision.datasets.CIFAR10(root, train=True, transform=test_tf)
    # fixed 25k/25k split, as in NAS-Bench-201
    perm = torch.randperm(len(full), generator=torch.Generator().manual_seed(seed)).tolist()
    train_idx, valid_idx = perm[:25000], perm[25000:]
    train_set = Subset(full, train_idx)
    valid_shard = Subset(full_eval, valid_idx[rank::world])
    return train_set, valid_shard


@torch.no_grad()
def oneshot_accuracy(net, arch, loader, device):
    net.eval()
    c = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        c[0] += (net(x, arch).argmax(1) == y).sum()
        c[1] += y.numel()
    dist.all_reduce(c)
    return (c[0] / c[1]).item()


def train_supernet(args, device, local_rank, rank, world, train_set):
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)
    model = DDP(NB201SuperNet().to(device), device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * world, momentum=0.9, weight_decay=5e-4, nesterov=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs * len(loader))
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        rng = random.Random(args.seed * 1000 + epoch)
        running = torch.zeros(2, device=device)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            arch = random_arch(rng)
            loss = F.cross_entropy(model(x, arch), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5)
            opt.step()
            sched.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(running)
        if rank == 0:
            print(f"[supernet] epoch {epoch} loss {(running[0] / running[1]).item():.4f}", flush=True)
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(args.workdir, "supernet.pth"))
    dist.barrier()


def search(args, device, rank, valid_shard):
    net = NB201SuperNet().to(device)
    state = torch.load(os.path.join(args.workdir, "supernet.pth"), map_location=device)
    net.load_state_dict(state)
    loader = DataLoader(valid_shard, batch_size=512, num_workers=4, pin_memory=True)
    rng = random.Random(args.seed + 1)
    space = list(itertools.product(OPS, repeat=len(EDGES)))
    candidates = rng.sample(space, args.num_candidates)
    results = []
    for i, arch in enumerate(candidates):
        acc = oneshot_accuracy(net, arch, loader, device)
        results.append({"arch": "|".join(arch), "oneshot_acc": acc})
        if rank == 0 and i % 10 == 0:
            print(f"[search] {i}/{len(candidates)} {arch} {acc:.4f}", flush=True)
    results.sort(key=lambda r: -r["oneshot_acc"])
    if rank == 0:
        with open(os.path.join(args.workdir, "ranking.json"), "w") as f:
            json.dump(results, f, indent=1)
        print("best:", results[0], flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="./data")
    p.add_argument("--workdir", default="work/nb201")
    p.add_argument("--epochs", type=int, default=250)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--lr", type=float, default=0.025, help="per 64 images")
    p.add_argument("--num-candidates", type=int, default=200)
    p.add_argument("--seed", type=int, default=777)
    p.add_argument("--search-only", action="store_true")
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    if rank == 0:
        os.makedirs(args.workdir, exist_ok=True)
    dist.barrier()

    train_set, valid_shard = get_data(args.data, rank, world, args.seed)
    if not args.search_only:
        train_supernet(args, device, local_rank, rank, world, train_set)
    search(args, device, rank, valid_shard)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
