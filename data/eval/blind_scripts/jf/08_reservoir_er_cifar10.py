"""Reservoir experience replay on Split CIFAR-10 (5 tasks x 2 classes), class-IL.

Every process keeps an independent reservoir over the part of the stream it
sees; the union of the per-rank buffers is the global memory. Buffers are
checkpointed per rank so that a run can be resumed after preemption.

    torchrun --nproc_per_node=4 08_reservoir_er_cifar10.py --out /shared/runs/er_c10
    torchrun --nproc_per_node=4 08_reservoir_er_cifar10.py --out /shared/runs/er_c10 --resume
"""
import argparse
import collections
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, models, transforms


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/shared/datasets/cifar10")
    p.add_argument("--out", default="/shared/runs/er_c10")
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=32, help="per GPU, stream")
    p.add_argument("--replay-size", type=int, default=32, help="per GPU, replay")
    p.add_argument("--mem-size", type=int, default=500, help="total memory, split over ranks")
    p.add_argument("--lr", type=float, default=0.1, help="for 4 GPUs")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


class Reservoir:
    def __init__(self, capacity):
        self.capacity = capacity
        self.x, self.y = [], []
        self.n_seen = 0
        self.rng = np.random.default_rng()

    def update(self, xb, yb):
        for x, y in zip(xb, yb):
            if len(self.x) < self.capacity:
                self.x.append(x.clone())
                self.y.append(y.clone())
            else:
                j = self.rng.integers(0, self.n_seen + 1)
                if j < self.capacity:
                    self.x[j], self.y[j] = x.clone(), y.clone()
            self.n_seen += 1

    def sample(self, n, device):
        idx = self.rng.choice(len(self.x), size=min(n, len(self.x)), replace=False)
        xs = torch.stack([self.x[i] for i in idx]).to(device, non_blocking=True)
        ys = torch.stack([self.y[i] for i in idx]).to(device, non_blocking=True)
        return xs, ys

    def state_dict(self):
        return {"x": torch.stack(self.x) if self.x else None, "y": torch.stack(self.y) if self.y else None,
                "n_seen": self.n_seen, "rng": self.rng.bit_generator.state}

    def load_state_dict(self, sd):
        self.x = list(sd["x"]) if sd["x"] is not None else []
        self.y = list(sd["y"]) if sd["y"] is not None else []
        self.n_seen = sd["n_seen"]
        self.rng.bit_generator.state = sd["rng"]


def resnet18_cifar(n_classes=10):
    m = models.resnet18(num_classes=n_classes)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


@torch.no_grad()
def accuracy_row(net, test_set, tasks, device, rank, world):
    """Accuracy on each seen task; counts are summed over ranks."""
    net.eval()
    y_all = np.array(test_set.targets)
    counts = torch.zeros(len(tasks), 2, device=device)
    for k, classes in enumerate(tasks):
        idx = np.where(np.isin(y_all, classes))[0][rank::world]
        for x, y in DataLoader(Subset(test_set, idx), batch_size=500, num_workers=2):
            x, y = x.to(device), y.to(device)
            counts[k, 0] += (net(x).argmax(1) == y).sum()
            counts[k, 1] += y.numel()
    dist.all_reduce(counts)
    net.train()
    return (100 * counts[:, 0] / counts[:, 1]).tolist()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    # class order must be the same on every rank: use a dedicated generator
    order = np.random.RandomState(args.seed).permutation(10).tolist()
    tasks = [order[i:i + 2] for i in range(0, 10, 2)]
    # model init / augmentation / reservoir decisions may differ per rank
    torch.manual_seed(args.seed + rank)

    norm = transforms.Normalize((0.4914, 0.4822, 0.4465), (0.247, 0.243, 0.261))
    train_set = datasets.CIFAR10(args.data, train=True, transform=transforms.Compose(
        [transforms.RandomCrop(32, 4), transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm]))
    test_set = datasets.CIFAR10(args.data, train=False, transform=transforms.Compose([transforms.ToTensor(), norm]))
    y_train = np.array(train_set.targets)

    net = resnet18_cifar().to(device)
    memory = Reservoir(args.mem_size // world)
    acc_matrix = np.zeros((len(tasks), len(tasks)))
    start_task = 0
    ckpt_path = os.path.join(args.out, "last.pt")
    if args.resume and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        assert ckpt["world_size"] == world, "per-rank buffers need the same number of processes"
        net.load_state_dict(ckpt["model"])
        acc_matrix = ckpt["acc_matrix"]
        start_task = ckpt["task"] + 1
        memory.load_state_dict(torch.load(os.path.join(args.out, f"buffer_rank{rank}.pt"),
                                          map_location="cpu"))
    # DDP broadcasts rank 0's weights, so the per-rank seeds above do not matter for the model
    model = DDP(net, device_ids=[local_rank])

    for t in range(start_task, len(tasks)):
        ds = Subset(train_set, np.where(np.isin(y_train, tasks[t]))[0])
        sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
        loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                            pin_memory=True, drop_last=True)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr * world / 4, momentum=0.9, weight_decay=5e-4)

        for ep in range(args.epochs):
            sampler.set_epoch(ep)
            tic, tot = time.time(), 0.0
            for x, y in loader:
                x_dev, y_dev = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                if len(memory.x) > 0:
                    mx, my = memory.sample(args.replay_size, device)
                    x_dev, y_dev = torch.cat([x_dev, mx]), torch.cat([y_dev, my])
                # one forward over stream + replay keeps BN statistics consistent
                loss = F.cross_entropy(model(x_dev), y_dev)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                memory.update(x, y)
                tot += loss.item()
            if rank == 0 and ep % 10 == 9:
                print(f"[task {t}] ep {ep + 1} loss {tot / len(loader):.3f} {time.time() - tic:.1f}s", flush=True)

        acc_matrix[t, :t + 1] = accuracy_row(net, test_set, tasks[:t + 1], device, rank, world)
        hist = collections.Counter(int(v) for v in memory.y)
        all_hist = [None] * world
        dist.all_gather_object(all_hist, dict(hist))

        os.makedirs(args.out, exist_ok=True)
        torch.save(memory.state_dict(), os.path.join(args.out, f"buffer_rank{rank}.pt"))
        if rank == 0:
            total = collections.Counter()
            for h in all_hist:
                total.update(h)
            print(f"task {t}: acc {np.round(acc_matrix[t, :t + 1], 2).tolist()} "
                  f"avg {acc_matrix[t, :t + 1].mean():.2f} | memory per class {dict(sorted(total.items()))}",
                  flush=True)
            torch.save({"model": net.state_dict(), "acc_matrix": acc_matrix, "task": t, "world_size": world},
                       ckpt_path)
        dist.barrier()

    if rank == 0:
        n = len(tasks)
        fgt = np.mean([acc_matrix[:n - 1, j].max() - acc_matrix[n - 1, j] for j in range(n - 1)])
        print(f"final avg acc {acc_matrix[-1].mean():.2f}  avg forgetting {fgt:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
