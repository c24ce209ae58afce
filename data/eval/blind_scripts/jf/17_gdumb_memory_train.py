"""GDumb (Prabhu et al., ECCV 2020) on class-incremental CIFAR-100 (20 tasks x 5 classes).

A greedy class-balancing sampler fills a memory of k samples from the stream;
after every task a fresh network is trained *from scratch* on the memory only
(SGDR + cutmix) and evaluated on all classes seen so far.

    torchrun --nproc_per_node=4 17_gdumb_memory_train.py --k 2000 --epochs 256
"""
import argparse
import collections
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torchvision import datasets, models, transforms


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/datasets/cifar100")
    p.add_argument("--out", default="./gdumb_out")
    p.add_argument("--k", type=int, default=2000, help="memory size")
    p.add_argument("--n-tasks", type=int, default=20)
    p.add_argument("--epochs", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16, help="per GPU")
    p.add_argument("--maxlr", type=float, default=0.05)
    p.add_argument("--minlr", type=float, default=5e-4)
    p.add_argument("--cutmix-prob", type=float, default=0.5)
    p.add_argument("--clip", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class GreedyBalancedMemory:
    def __init__(self, k):
        self.k = k
        self.by_class = collections.defaultdict(list)

    def __len__(self):
        return sum(len(v) for v in self.by_class.values())

    def add(self, idx, y):
        n_cls = len(self.by_class) + (0 if y in self.by_class else 1)
        if len(self) < self.k:
            self.by_class[y].append(idx)
        elif len(self.by_class[y]) < self.k // n_cls:
            largest = max(self.by_class, key=lambda c: len(self.by_class[c]))
            self.by_class[largest].pop(np.random.RandomState(idx).randint(len(self.by_class[largest])))
            self.by_class[y].append(idx)

    def indices(self):
        return [i for c in sorted(self.by_class) for i in self.by_class[c]]


def cutmix(x, y, alpha=1.0):
    lam = np.random.beta(alpha, alpha)
    perm = torch.randperm(x.size(0), device=x.device)
    H, W = x.shape[2:]
    rh, rw = int(H * np.sqrt(1 - lam)), int(W * np.sqrt(1 - lam))
    cy, cx = np.random.randint(H), np.random.randint(W)
    y1, y2 = np.clip(cy - rh // 2, 0, H), np.clip(cy + rh // 2, 0, H)
    x1, x2 = np.clip(cx - rw // 2, 0, W), np.clip(cx + rw // 2, 0, W)
    x[:, :, y1:y2, x1:x2] = x[perm, :, y1:y2, x1:x2]
    lam = 1 - ((x2 - x1) * (y2 - y1) / (H * W))
    return x, y, y[perm], lam


def make_net(n_classes=100):
    m = models.resnet18(num_classes=n_classes)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


def train_from_scratch(mem_ds, args, device, local_rank, world, rank):
    net = make_net().to(device)
    model = DDP(net, device_ids=[local_rank])
    loader = DataLoader(mem_ds, batch_size=args.batch_size, shuffle=True, num_workers=4,
                        pin_memory=True, drop_last=True)
    opt = torch.optim.SGD(model.parameters(), lr=args.maxlr * world, momentum=0.9, weight_decay=1e-6)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=1, T_mult=2, eta_min=args.minlr)
    for ep in range(args.epochs):
        tot = 0.0
        for i, (x, y) in enumerate(loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if np.random.rand() < args.cutmix_prob:
                x, ya, yb, lam = cutmix(x, y)
                out = model(x)
                loss = lam * F.cross_entropy(out, ya) + (1 - lam) * F.cross_entropy(out, yb)
            else:
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            sched.step(ep + i / len(loader))
            tot += loss.item()
        if rank == 0 and (ep + 1) % 32 == 0:
            print(f"    ep {ep + 1}/{args.epochs} loss {tot / len(loader):.4f}", flush=True)
    return net


@torch.no_grad()
def eval_classes(net, test_set, y_test, classes, device, rank, world):
    net.eval()
    idx = np.where(np.isin(y_test, classes))[0][rank::world]
    mask = torch.full((100,), float("-inf"), device=device)
    mask[torch.as_tensor(classes, device=device)] = 0
    s = torch.zeros(2, device=device)
    for x, y in DataLoader(Subset(test_set, idx), batch_size=500, num_workers=2):
        x, y = x.to(device), y.to(device)
        s[0] += ((net(x) + mask).argmax(1) == y).sum()
        s[1] += y.numel()
    dist.all_reduce(s)
    return (s[0] / s[1]).item() * 100


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    norm = transforms.Normalize((0.5071, 0.4867, 0.4408), (0.2675, 0.2565, 0.2761))
    train_set = datasets.CIFAR100(args.data, train=True, transform=transforms.Compose([
        transforms.RandomCrop(32, 4), transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm]))
    test_set = datasets.CIFAR100(args.data, train=False, transform=transforms.Compose([transforms.ToTensor(), norm]))
    y_train, y_test = np.array(train_set.targets), np.array(test_set.targets)

    # the stream is identical on every rank, so every rank builds the same memory
    stream_rng = np.random.RandomState(args.seed)
    order = stream_rng.permutation(100)
    cpt = 100 // args.n_tasks
    memory = GreedyBalancedMemory(args.k)
    results = {}

    for t in range(args.n_tasks):
        classes = order[t * cpt:(t + 1) * cpt]
        stream = stream_rng.permutation(np.where(np.isin(y_train, classes))[0])
        for i in stream:
            memory.add(int(i), int(y_train[i]))
        tic = time.time()
        if rank == 0:
            print(f"task {t}: memory {len(memory)} samples over {len(memory.by_class)} classes", flush=True)
        net = train_from_scratch(Subset(train_set, memory.indices()), args, device, local_rank, world, rank)

        seen = order[:(t + 1) * cpt].tolist()
        row = [eval_classes(net, test_set, y_test, order[j * cpt:(j + 1) * cpt].tolist(), device, rank, world)
               for j in range(t + 1)]
        overall = eval_classes(net, test_set, y_test, seen, device, rank, world)
        results[t] = {"per_task": row, "overall": overall}
        if rank == 0:
            print(f"== task {t}: acc on {len(seen)} classes {overall:.2f} ({time.time() - tic:.0f}s)", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save(net.state_dict(), os.path.join(args.out, f"gdumb_task{t}.pt"))
            with open(os.path.join(args.out, "results.json"), "w") as f:
                json.dump(results, f, indent=1)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
