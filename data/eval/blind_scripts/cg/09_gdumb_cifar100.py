"""GDumb (Prabhu et al., ECCV 2020) on class-incremental CIFAR-100, DDP version.

Greedy class-balanced sampler fills the memory from the stream; at the end of every task a
fresh network is trained from scratch on the memory only (SGDR + cutmix), then evaluated on
all classes seen so far.

  torchrun --nproc_per_node=4 09_gdumb_cifar100.py --mem 2000 --epochs 256 --logdir logs/gdumb_k2000
"""
import argparse
import json
import os
import time
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, transforms
from torchvision.models import resnet18


def get_parser():
    p = argparse.ArgumentParser("GDumb")
    p.add_argument("--data", default="/data/cifar")
    p.add_argument("--logdir", default="logs/gdumb")
    p.add_argument("--mem", type=int, default=2000)
    p.add_argument("--num-tasks", type=int, default=20)
    p.add_argument("--epochs", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4, help="per process (x4 GPUs = 16)")
    p.add_argument("--maxlr", type=float, default=0.05)
    p.add_argument("--minlr", type=float, default=5e-4)
    p.add_argument("--clip", type=float, default=10.0)
    p.add_argument("--cutmix-prob", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    return p


class GreedyClassBalancedMemory:
    """Adds a sample if its class is below the current per-class quota; otherwise evicts
    a random sample from the currently largest class."""

    def __init__(self, capacity, seed):
        self.capacity = capacity
        self.by_class = defaultdict(list)
        self.rng = np.random.RandomState(seed)

    def __len__(self):
        return sum(len(v) for v in self.by_class.values())

    def add(self, idx, y):
        n_cls = len(self.by_class) + (0 if y in self.by_class else 1)
        if len(self) < self.capacity:
            self.by_class[y].append(idx)
        elif len(self.by_class[y]) < self.capacity // n_cls:
            largest = max(self.by_class, key=lambda c: len(self.by_class[c]))
            self.by_class[largest].pop(self.rng.randint(len(self.by_class[largest])))
            self.by_class[y].append(idx)

    def indices(self):
        return [i for c in sorted(self.by_class) for i in self.by_class[c]]

    def classes(self):
        return sorted(self.by_class)


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


def build_model(n_classes, device):
    m = resnet18(num_classes=n_classes)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return nn.SyncBatchNorm.convert_sync_batchnorm(m).to(device)


@torch.no_grad()
def test(model, test_set, y_test, classes, seen, device, rank, world):
    """Accuracy on `classes`, predicting among all classes seen so far; summed over ranks."""
    model.eval()
    idx = np.flatnonzero(np.isin(y_test, classes))[rank::world]
    mask = torch.full((100,), float("-inf"), device=device)
    mask[seen] = 0
    buf = torch.zeros(2, device=device)
    for x, y in DataLoader(Subset(test_set, idx), batch_size=250, num_workers=2):
        x, y = x.to(device), y.to(device)
        buf[0] += ((model(x) + mask).argmax(1) == y).sum()
        buf[1] += y.numel()
    dist.all_reduce(buf)
    return (buf[0] / buf[1]).item() * 100


def main():
    args = get_parser().parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    np.random.seed(args.seed + rank)  # cutmix boxes may differ per rank
    writer = SummaryWriter(args.logdir) if rank == 0 else None

    mean, std = (0.5071, 0.4866, 0.4409), (0.2009, 0.1984, 0.2023)
    tr_tf = transforms.Compose([transforms.RandomCrop(32, 4), transforms.RandomHorizontalFlip(),
                                transforms.ToTensor(), transforms.Normalize(mean, std)])
    te_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])
    if rank == 0:
        datasets.CIFAR100(args.data, train=True, download=True)
        datasets.CIFAR100(args.data, train=False, download=True)
    dist.barrier()
    train_set = datasets.CIFAR100(args.data, train=True, transform=tr_tf)
    test_set = datasets.CIFAR100(args.data, train=False, transform=te_tf)
    y_train, y_test = np.asarray(train_set.targets), np.asarray(test_set.targets)

    order = np.random.RandomState(1993).permutation(100)
    cpt = 100 // args.num_tasks
    memory = GreedyClassBalancedMemory(args.mem, seed=args.seed)
    stream_rng = np.random.RandomState(args.seed)
    acc = np.zeros((args.num_tasks, args.num_tasks))

    for t in range(args.num_tasks):
        task_classes = order[t * cpt:(t + 1) * cpt]
        stream = np.flatnonzero(np.isin(y_train, task_classes))
        stream_rng.shuffle(stream)
        for i in stream:
            memory.add(int(i), int(y_train[i]))

        model = DDP(build_model(100, device), device_ids=[local_rank])
        mem_ds = Subset(train_set, memory.indices())
        sampler = DistributedSampler(mem_ds, shuffle=True, seed=args.seed)
        loader = DataLoader(mem_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                            pin_memory=True, drop_last=True)
        opt = torch.optim.SGD(model.parameters(), lr=args.maxlr, momentum=0.9, weight_decay=1e-6)
        sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=1, T_mult=2,
                                                                     eta_min=args.minlr)
        seen = torch.as_tensor(memory.classes(), device=device)
        mask = torch.full((100,), float("-inf"), device=device)
        mask[seen] = 0

        t0 = time.time()
        for ep in range(args.epochs):
            model.train()
            for it, (x, y) in enumerate(loader):
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
                sched.step(ep + it / len(loader))
            if writer is not None and ep % 16 == 0:
                writer.add_scalar(f"task{t}/loss", loss.item(), ep)
                writer.add_scalar(f"task{t}/lr", opt.param_groups[0]["lr"], ep)
        if rank == 0:
            print(f"task {t}: trained on {len(mem_ds)} samples in {time.time() - t0:.0f}s", flush=True)

        seen_list = memory.classes()
        for j in range(t + 1):
            acc[t, j] = test(model.module, test_set, y_test, order[j * cpt:(j + 1) * cpt].tolist(),
                             seen_list, device, rank, world)
        overall = test(model.module, test_set, y_test, order[:(t + 1) * cpt].tolist(), seen_list,
                       device, rank, world)
        if rank == 0:
            writer.add_scalar("acc/overall", overall, t)
            print(f"task {t}: overall {overall:.2f}  per-task {np.round(acc[t, :t + 1], 1).tolist()}",
                  flush=True)
            os.makedirs(args.logdir, exist_ok=True)
            with open(os.path.join(args.logdir, "acc.json"), "w") as f:
                json.dump({"acc": acc.tolist(), "memory": memory.indices()}, f)

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
