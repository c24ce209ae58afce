"""ER-ACE (Caccia et al., ICLR 2022) for online class-incremental learning on Split CIFAR-100.

Single pass over the stream, 20 tasks of 5 classes, reservoir buffer on every GPU.
Processes are started with torch.multiprocessing (one per GPU):

    python 20_er_ace_online_cifar100.py --dist-url tcp://127.0.0.1:23456 --mem-size 5000 --out runs/erace
"""
import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from torchvision.models import resnet18

parser = argparse.ArgumentParser(description="ER-ACE online CIL")
parser.add_argument("--data", default="./data")
parser.add_argument("--out", default="runs/erace")
parser.add_argument("--dist-url", default="tcp://127.0.0.1:23456")
parser.add_argument("--world-size", type=int, default=1, help="number of nodes")
parser.add_argument("--node-rank", type=int, default=0)
parser.add_argument("--n-tasks", type=int, default=20)
parser.add_argument("--mem-size", type=int, default=5000)
parser.add_argument("--batch-size", type=int, default=10)
parser.add_argument("--buffer-batch-size", type=int, default=10)
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--seed", type=int, default=0)


class Reservoir:
    def __init__(self, capacity, device, seed):
        self.capacity, self.seen = capacity, 0
        self.x = torch.zeros(capacity, 3, 32, 32, device=device)
        self.y = torch.zeros(capacity, dtype=torch.long, device=device)
        self.rng = random.Random(seed)

    def __len__(self):
        return min(self.seen, self.capacity)

    def update(self, x, y):
        for xi, yi in zip(x, y):
            if self.seen < self.capacity:
                j = self.seen
            else:
                j = self.rng.randint(0, self.seen)
            if j < self.capacity:
                self.x[j], self.y[j] = xi, yi
            self.seen += 1

    def sample(self, n):
        idx = torch.tensor(self.rng.sample(range(len(self)), min(n, len(self))), device=self.x.device)
        return self.x[idx], self.y[idx]


def make_net(n_classes):
    net = resnet18(num_classes=n_classes)
    net.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    net.maxpool = nn.Identity()
    return net


@torch.no_grad()
def evaluate(net, test, y_test, order, cpt, upto, device, rank, world):
    net.eval()
    accs = []
    for j in range(upto + 1):
        cls = order[j * cpt:(j + 1) * cpt]
        idx = np.flatnonzero(np.isin(y_test, cls))[rank::world]
        c = torch.zeros(2, device=device)
        for x, y in DataLoader(Subset(test, idx), batch_size=500):
            x, y = x.to(device), y.to(device)
            c[0] += (net(x).argmax(1) == y).sum()
            c[1] += len(y)
        dist.all_reduce(c)
        accs.append((c[0] / c[1]).item() * 100)
    net.train()
    return accs


def main_worker(gpu, ngpus_per_node, args):
    rank = args.node_rank * ngpus_per_node + gpu
    world = args.world_size * ngpus_per_node
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", init_method=args.dist_url, world_size=world, rank=rank)
    device = torch.device("cuda", gpu)
    torch.manual_seed(args.seed)

    tf = transforms.Compose([transforms.ToTensor(),
                             transforms.Normalize((0.5071, 0.4866, 0.4409), (0.2673, 0.2564, 0.2762))])
    train = datasets.CIFAR100(args.data, train=True, transform=tf)
    test = datasets.CIFAR100(args.data, train=False, transform=tf)
    y_train, y_test = np.asarray(train.targets), np.asarray(test.targets)
    order = np.random.RandomState(args.seed).permutation(100)
    cpt = 100 // args.n_tasks

    net = make_net(100).to(device)
    model = DDP(net, device_ids=[gpu])
    # --lr is the single-GPU value for an incoming batch of 10; scale with the number of replicas
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * world)
    buf = Reservoir(args.mem_size // world, device, seed=args.seed + rank)
    seen_mask = torch.zeros(100, dtype=torch.bool, device=device)
    acc = np.zeros((args.n_tasks, args.n_tasks))
    tic = time.time()

    for t in range(args.n_tasks):
        ds = Subset(train, np.flatnonzero(np.isin(y_train, order[t * cpt:(t + 1) * cpt])))
        sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
        sampler.set_epoch(t)
        loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=2, drop_last=True)
        seen_mask[torch.as_tensor(order[t * cpt:(t + 1) * cpt], device=device)] = True
        model.train()
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            n_in = x.size(0)
            if len(buf) > 0:
                bx, by = buf.sample(args.buffer_batch_size)
                logits = model(torch.cat([x, bx]))
            else:
                by = None
                logits = model(x)
            # asymmetric CE: incoming data only competes with classes present in the batch
            present = torch.zeros(100, dtype=torch.bool, device=device)
            present[y] = True
            inc_logits = logits[:n_in].masked_fill(~present, -1e9)
            loss = F.cross_entropy(inc_logits, y)
            if by is not None:
                loss = loss + F.cross_entropy(logits[n_in:].masked_fill(~seen_mask, -1e9), by)
            opt.zero_grad()
            loss.backward()
            opt.step()
            buf.update(x, y)

        acc[t, : t + 1] = evaluate(net, test, y_test, order, cpt, t, device, rank, world)
        if rank == 0:
            fgt = np.mean([acc[j:t, j].max() - acc[t, j] for j in range(t)]) if t else 0.0
            print(f"[{time.time() - tic:.0f}s] task {t}: avg acc {acc[t, :t + 1].mean():.2f}  "
                  f"forgetting {fgt:.2f}", flush=True)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        torch.save({"model": net.state_dict(), "acc": acc}, os.path.join(args.out, "erace_final.pt"))
        np.savetxt(os.path.join(args.out, "acc.csv"), acc, fmt="%.2f", delimiter=",")
    dist.barrier()
    dist.destroy_process_group()


def main():
    args = parser.parse_args()
    random.seed(args.seed)
    datasets.CIFAR100(args.data, train=True, download=True)
    datasets.CIFAR100(args.data, train=False, download=True)
    ngpus_per_node = torch.cuda.device_count()
    mp.spawn(main_worker, nprocs=ngpus_per_node, args=(args, ngpus_per_node))


if __name__ == "__main__":
    main()
