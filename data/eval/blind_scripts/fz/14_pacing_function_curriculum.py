"""Curriculum learning with transfer scoring and an exponential pacing function
(Hacohen & Weinshall, 2019), CIFAR-100 subsets, multi-GPU.

Difficulty scores come from a teacher (e.g. the confidence of an ImageNet
pretrained network + logistic regression), computed once offline and stored in
an .npy file.  The pacing function g(i) gives the fraction of the easiest
samples available at iteration i:
    g(i) = min(1, start * inc ** floor(i / step_length))

    torchrun --nproc_per_node=4 14_pacing_function_curriculum.py \
        --scores scores/cifar100_transfer_conf.npy --start 0.04 --inc 1.9 --step-length 100
"""
import argparse
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Sampler, Subset


class DistributedCurriculumSampler(Sampler):
    """Shuffles the `pace` easiest samples and gives each rank an equal slice."""

    def __init__(self, order, num_replicas, rank, batch_size, seed=0):
        self.order = torch.as_tensor(order)       # sample ids, easiest first
        self.num_replicas, self.rank = num_replicas, rank
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.pace = len(order)

    def set_pace(self, n_available):
        chunk = self.num_replicas * self.batch_size
        self.pace = max(chunk, (min(n_available, len(self.order)) // chunk) * chunk)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        pool = self.order[: self.pace]
        pool = pool[torch.randperm(len(pool), generator=g)]
        return iter(pool[self.rank::self.num_replicas].tolist())

    def __len__(self):
        return self.pace // self.num_replicas


def pacing(iteration, n, start, inc, step_length):
    return int(n * min(1.0, start * inc ** math.floor(iteration / step_length)))


class SmallCNN(nn.Module):
    def __init__(self, num_classes=100):
        super().__init__()

        def block(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ELU(),
                                 nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ELU(),
                                 nn.MaxPool2d(2), nn.Dropout(0.25))

        self.body = nn.Sequential(block(3, 64), block(64, 128), block(128, 256))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(256 * 16, 512), nn.ELU(), nn.Dropout(0.5),
                                  nn.Linear(512, num_classes))

    def forward(self, x):
        return self.head(self.body(x))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="./data")
    ap.add_argument("--scores", required=True, help=".npy with one difficulty score per training image")
    ap.add_argument("--lower-is-easier", action="store_true", help="scores are losses rather than confidences")
    ap.add_argument("--start", type=float, default=0.04)
    ap.add_argument("--inc", type=float, default=1.9)
    ap.add_argument("--step-length", type=int, default=100)
    ap.add_argument("--iterations", type=int, default=14000)
    ap.add_argument("--batch-size", type=int, default=100, help="per GPU")
    ap.add_argument("--lr", type=float, default=0.035)
    ap.add_argument("--lr-decay-every", type=int, default=1800)
    ap.add_argument("--out", default="runs/pacing")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    norm = T.Normalize((0.507, 0.487, 0.441), (0.267, 0.256, 0.276))
    if rank == 0:
        torchvision.datasets.CIFAR100(args.data, train=True, download=True)
        torchvision.datasets.CIFAR100(args.data, train=False, download=True)
    dist.barrier()
    train = torchvision.datasets.CIFAR100(args.data, train=True, transform=T.Compose(
        [T.RandomCrop(32, 4), T.RandomHorizontalFlip(), T.ToTensor(), norm]))
    test = torchvision.datasets.CIFAR100(args.data, train=False, transform=T.Compose([T.ToTensor(), norm]))

    scores = np.load(args.scores)
    assert len(scores) == len(train), "score file does not match the training set"
    order = np.argsort(scores if args.lower_is_easier else -scores, kind="stable")

    sampler = DistributedCurriculumSampler(order, world, rank, args.batch_size, seed=7)
    test_loader = DataLoader(Subset(test, range(rank, len(test), world)), batch_size=500, num_workers=4)

    model = DDP(SmallCNN().to(device), device_ids=[local_rank])
    lr = args.lr * world
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)

    it = 0
    epoch = 0
    while it < args.iterations:
        sampler.set_pace(pacing(it, len(train), args.start, args.inc, args.step_length))
        loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                            pin_memory=True, drop_last=True)
        model.train()
        run = torch.zeros(2, device=device)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            for g in optimizer.param_groups:
                g["lr"] = lr * (0.5 ** (it // args.lr_decay_every))
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
            it += 1
            # the pace can only change at step-length boundaries; start a new pass there
            if it % args.step_length == 0 or it >= args.iterations:
                break
        dist.all_reduce(run)

        if it % 1000 == 0 or it >= args.iterations:
            model.eval()
            c = torch.zeros(2, device=device)
            with torch.no_grad():
                for x, y in test_loader:
                    x, y = x.to(device), y.to(device)
                    c[0] += (model.module(x).argmax(1) == y).sum()
                    c[1] += y.numel()
            dist.all_reduce(c)
            if rank == 0:
                print(f"iter {it} pass {epoch} pace {sampler.pace} loss {run[0] / run[1]:.4f} "
                      f"test_acc {c[0] / c[1]:.4f}", flush=True)
        epoch += 1

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        torch.save({"model": model.module.state_dict(), "iterations": it, "args": vars(args)},
                   os.path.join(args.out, "final.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
