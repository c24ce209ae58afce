"""Task-incremental Split CIFAR-100 with a reduced ResNet-18 (nf=20, as in GEM/A-GEM),
one head per task and a small episodic memory replayed through each sample's own head.

Single node, one process per GPU started with torch.multiprocessing:
    python 08_er_multihead_spawn.py --gpus 4 --mem-per-task 260 --epochs 1
"""
import argparse
import os
import socket
from contextlib import closing

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def free_port():
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.short = nn.Sequential()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.b1(self.c1(x)))
        return F.relu(self.b2(self.c2(out)) + self.short(x))


class ReducedResNet18(nn.Module):
    def __init__(self, n_tasks, cpt, nf=20):
        super().__init__()
        self.conv = nn.Conv2d(3, nf, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(nf)
        layers, cin = [], nf
        for mult, stride in [(1, 1), (2, 2), (4, 2), (8, 2)]:
            layers += [BasicBlock(cin, nf * mult, stride), BasicBlock(nf * mult, nf * mult)]
            cin = nf * mult
        self.layers = nn.Sequential(*layers)
        self.heads = nn.ModuleList(nn.Linear(cin, cpt) for _ in range(n_tasks))

    def forward(self, x, task_ids):
        h = F.relu(self.bn(self.conv(x)))
        h = F.adaptive_avg_pool2d(self.layers(h), 1).flatten(1)
        out = h.new_zeros(h.size(0), self.heads[0].out_features)
        for t in task_ids.unique().tolist():
            m = task_ids == t
            out[m] = self.heads[t](h[m])
        return out


class TaskData(Dataset):
    """Wraps a CIFAR subset and returns (x, within-task label, task id)."""

    def __init__(self, base, indices, class_order, cpt):
        self.base, self.indices = base, np.asarray(indices)
        self.pos = {c: i for i, c in enumerate(class_order)}
        self.cpt = cpt

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        x, c = self.base[int(self.indices[i])]
        p = self.pos[c]
        return x, p % self.cpt, p // self.cpt


def loop(loader):
    sampler, epoch = loader.sampler, 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def worker(rank, world_size, port, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    tf = transforms.Compose([transforms.ToTensor(),
                             transforms.Normalize((0.507, 0.487, 0.441), (0.267, 0.256, 0.276))])
    train = datasets.CIFAR100(args.data, train=True, transform=tf)
    test = datasets.CIFAR100(args.data, train=False, transform=tf)
    order = np.random.RandomState(args.seed).permutation(100).tolist()
    cpt = 100 // args.tasks
    y_tr, y_te = np.asarray(train.targets), np.asarray(test.targets)

    # future heads get no gradient until their task starts -> find_unused_parameters
    net = ReducedResNet18(args.tasks, cpt).to(device)
    model = DDP(net, device_ids=[rank], find_unused_parameters=True)
    # --batch-size is per GPU; scale the single-GPU lr linearly with the number of GPUs
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * world_size)
    mem_idx = []
    mem_rng = np.random.RandomState(args.seed + 1)
    R = torch.zeros(args.tasks, args.tasks)

    for t in range(args.tasks):
        cls = order[t * cpt:(t + 1) * cpt]
        cur = TaskData(train, np.flatnonzero(np.isin(y_tr, cls)), order, cpt)
        sampler = DistributedSampler(cur, shuffle=True, seed=args.seed)
        loader = DataLoader(cur, batch_size=args.batch_size, sampler=sampler, num_workers=2,
                            drop_last=True)
        mem_iter = None
        if mem_idx:
            mem = TaskData(train, mem_idx, order, cpt)
            mem_loader = DataLoader(mem, batch_size=args.batch_size, num_workers=1, drop_last=False,
                                    sampler=DistributedSampler(mem, shuffle=True, seed=args.seed + t))
            mem_iter = loop(mem_loader)

        model.train()
        for ep in range(args.epochs):
            sampler.set_epoch(ep)
            for x, y, tid in loader:
                if mem_iter is not None:
                    mx, my, mt = next(mem_iter)
                    x, y, tid = torch.cat([x, mx]), torch.cat([y, my]), torch.cat([tid, mt])
                x, y, tid = x.to(device), y.to(device), tid.to(device)
                loss = F.cross_entropy(model(x, tid), y)
                opt.zero_grad()
                loss.backward()
                opt.step()

        # episodic memory: same random picks on every rank
        pool = np.flatnonzero(np.isin(y_tr, cls))
        mem_idx += mem_rng.choice(pool, args.mem_per_task, replace=False).tolist()

        net.eval()
        with torch.no_grad():
            for j in range(t + 1):
                cj = order[j * cpt:(j + 1) * cpt]
                te = TaskData(test, np.flatnonzero(np.isin(y_te, cj))[rank::world_size], order, cpt)
                cnt = torch.zeros(2, device=device)
                for x, y, tid in DataLoader(te, batch_size=256):
                    x, y, tid = x.to(device), y.to(device), tid.to(device)
                    cnt += torch.stack([(net(x, tid).argmax(1) == y).sum().float(),
                                        torch.tensor(float(len(y)), device=device)])
                dist.all_reduce(cnt)
                R[t, j] = (cnt[0] / cnt[1]).item()
        net.train()

        if rank == 0:
            acc = R[t, : t + 1].mean().item()
            bwt = (R[t, :t] - R.diag()[:t]).mean().item() if t else 0.0
            print(f"task {t:2d} | ACC {100 * acc:.2f} | BWT {100 * bwt:.2f}", flush=True)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        torch.save({"model": net.state_dict(), "R": R, "args": vars(args)},
                   os.path.join(args.out, "er_multihead.pt"))
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="./data")
    p.add_argument("--out", default="./out/er_multihead")
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--tasks", type=int, default=10)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=10)
    p.add_argument("--mem-per-task", type=int, default=260)
    p.add_argument("--lr", type=float, default=0.03)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    # download once, before any worker starts
    datasets.CIFAR100(args.data, train=True, download=True)
    datasets.CIFAR100(args.data, train=False, download=True)
    mp.spawn(worker, args=(args.gpus, free_port(), args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
