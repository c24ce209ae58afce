"""GDumb (Prabhu et al., ECCV 2020) on class-incremental CIFAR-100.

A greedy class-balanced sampler fills a memory of k samples from the stream;
at every evaluation point a network is trained from scratch on the memory only
(SGDR + cutmix) and tested on all classes seen so far.

    torchrun --nproc_per_node=4 13_gdumb_balanced_memory.py --k 2000 --num_passes 256
"""
import argparse
import os
import time
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", default="./data")
    p.add_argument("--log_dir", default="./logs/gdumb")
    p.add_argument("--k", type=int, default=2000, help="memory size")
    p.add_argument("--num_tasks", type=int, default=20)
    p.add_argument("--num_passes", type=int, default=256)
    p.add_argument("--batch_size", type=int, default=16, help="global, as in the paper")
    p.add_argument("--maxlr", type=float, default=0.05)
    p.add_argument("--minlr", type=float, default=5e-4)
    p.add_argument("--clip", type=float, default=10.0)
    p.add_argument("--cutmix_prob", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class GreedyClassBalancedMemory:
    def __init__(self, k, rng):
        self.k, self.rng = k, rng
        self.items = defaultdict(list)  # class -> list of dataset indices

    def __len__(self):
        return sum(len(v) for v in self.items.values())

    def add(self, idx, y):
        if len(self) < self.k:
            self.items[y].append(idx)
            return
        largest = max(self.items, key=lambda c: len(self.items[c]))
        if len(self.items[y]) < len(self.items[largest]):
            victim = self.rng.randint(len(self.items[largest]))
            self.items[largest].pop(victim)
            self.items[y].append(idx)

    def indices(self):
        return [i for c in sorted(self.items) for i in self.items[c]]


def cutmix(x, y, alpha=1.0):
    lam = np.random.beta(alpha, alpha)
    perm = torch.randperm(x.size(0), device=x.device)
    H, W = x.shape[2:]
    rh, rw = int(H * np.sqrt(1 - lam)), int(W * np.sqrt(1 - lam))
    cy, cx = np.random.randint(H), np.random.randint(W)
    y1, y2 = np.clip(cy - rh // 2, 0, H), np.clip(cy + rh // 2, 0, H)
    x1, x2 = np.clip(cx - rw // 2, 0, W), np.clip(cx + rw // 2, 0, W)
    x[:, :, y1:y2, x1:x2] = x[perm, :, y1:y2, x1:x2]
    lam = 1 - ((y2 - y1) * (x2 - x1) / (H * W))
    return x, y, y[perm], lam


def resnet18_cifar(n):
    m = torchvision.models.resnet18(num_classes=n)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


@torch.no_grad()
def test(net, test_set, y_test, seen, tasks, rank, world, device):
    net.eval()
    mask = torch.full((100,), float("-inf"), device=device)
    mask[seen] = 0
    accs = []
    for classes in tasks:
        idx = np.where(np.isin(y_test, classes))[0][rank::world]
        correct, total = 0, 0
        for x, y in DataLoader(Subset(test_set, idx.tolist()), batch_size=500, num_workers=2):
            pred = (net(x.to(device)) + mask).argmax(1).cpu()
            correct += (pred == y).sum().item()
            total += y.numel()
        stats = torch.tensor([correct, total], dtype=torch.float64)
        dist.all_reduce(stats)
        accs.append(100.0 * stats[0].item() / stats[1].item())
    return accs


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)
    np.random.seed(args.seed + rank)

    norm = transforms.Normalize((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))
    train_set = torchvision.datasets.CIFAR100(args.data_dir, train=True, transform=transforms.Compose(
        [transforms.RandomCrop(32, 4), transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm]))
    test_set = torchvision.datasets.CIFAR100(args.data_dir, train=False,
                                             transform=transforms.Compose([transforms.ToTensor(), norm]))
    y_train, y_test = np.asarray(train_set.targets), np.asarray(test_set.targets)

    # stream order and memory decisions use their own seeded RNG -> identical memory on all ranks
    stream_rng = np.random.RandomState(args.seed)
    order = stream_rng.permutation(100)
    cpt = 100 // args.num_tasks
    tasks = [order[t * cpt:(t + 1) * cpt].tolist() for t in range(args.num_tasks)]
    memory = GreedyClassBalancedMemory(args.k, stream_rng)
    acc = np.zeros((args.num_tasks, args.num_tasks))
    if rank == 0:
        os.makedirs(args.log_dir, exist_ok=True)

    for t, classes in enumerate(tasks):
        stream = stream_rng.permutation(np.where(np.isin(y_train, classes))[0])
        for i in stream:
            memory.add(int(i), int(y_train[i]))
        seen = sorted(c for cl in tasks[:t + 1] for c in cl)

        # GDumb: fresh model trained only on the memory
        # only batch_size / world samples per GPU -> synchronise BN statistics over ranks
        net = nn.SyncBatchNorm.convert_sync_batchnorm(resnet18_cifar(100)).to(device)
        model = DDP(net, device_ids=[local_rank])
        mem_data = Subset(train_set, memory.indices())
        sampler = DistributedSampler(mem_data, shuffle=True, seed=args.seed + t)
        loader = DataLoader(mem_data, batch_size=args.batch_size // world, sampler=sampler,
                            num_workers=4, pin_memory=True, drop_last=True)
        opt = torch.optim.SGD(model.parameters(), lr=args.maxlr, momentum=0.9, weight_decay=1e-6)
        sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=1, T_mult=2, eta_min=args.minlr)
        mask = torch.full((100,), float("-inf"), device=device)
        mask[seen] = 0
        tic = time.time()
        for epoch in range(args.num_passes):
            sampler.set_epoch(epoch)
            model.train()
            for i, (x, y) in enumerate(loader):
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                if np.random.rand() < args.cutmix_prob:
                    x, ya, yb, lam = cutmix(x, y)
                    out = model(x) + mask
                    loss = lam * F.cross_entropy(out, ya) + (1 - lam) * F.cross_entropy(out, yb)
                else:
                    loss = F.cross_entropy(model(x) + mask, y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), args.clip)
                opt.step()
                sched.step(epoch + i / len(loader))
            if rank == 0 and epoch % 32 == 0:
                print(f"[eval point {t}] pass {epoch} loss {loss.item():.3f} mem {len(memory)} "
                      f"({time.time() - tic:.0f}s)", flush=True)

        acc[t, :t + 1] = test(net, test_set, y_test, seen, tasks[:t + 1], rank, world, device)
        if rank == 0:
            print(f"== after task {t}: avg acc {acc[t, :t + 1].mean():.2f}", flush=True)
            torch.save({"model": net.state_dict(), "memory": memory.indices(), "acc": acc},
                       os.path.join(args.log_dir, f"gdumb_t{t}.pt"))
        dist.barrier()

    if rank == 0:
        np.savetxt(os.path.join(args.log_dir, "acc.txt"), acc, fmt="%.2f")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
