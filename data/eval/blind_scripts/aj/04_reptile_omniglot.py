"""Distributed Reptile on Omniglot (N-way K-shot).

Every worker adapts the shared initialisation on its own meta-batch of tasks;
the Reptile outer direction (phi - theta) is averaged over all workers with an
all-reduce, so the effective meta-batch is meta_batch * world_size.

torchrun --nproc_per_node=4 04_reptile_omniglot.py --ways 5 --shots 1
"""
import argparse
import copy
import os
import random
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.tensorboard import SummaryWriter
import torchvision.transforms as T
from torchvision.datasets import Omniglot


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="./data")
    ap.add_argument("--ways", type=int, default=5)
    ap.add_argument("--shots", type=int, default=1)
    ap.add_argument("--query", type=int, default=5)
    ap.add_argument("--meta-iters", type=int, default=100000)
    ap.add_argument("--meta-batch", type=int, default=5, help="tasks per worker")
    ap.add_argument("--meta-lr", type=float, default=1.0)
    ap.add_argument("--inner-lr", type=float, default=1e-3)
    ap.add_argument("--inner-steps", type=int, default=5)
    ap.add_argument("--inner-batch", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=1000)
    ap.add_argument("--eval-tasks", type=int, default=200, help="per worker")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--logdir", default="runs/reptile")
    return ap.parse_args()


class ConvNet(nn.Module):
    def __init__(self, ways, hidden=64):
        super().__init__()
        layers, cin = [], 1
        for _ in range(4):
            layers += [nn.Conv2d(cin, hidden, 3, 2, 1), nn.BatchNorm2d(hidden), nn.ReLU()]
            cin = hidden
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(hidden * 2 * 2, ways)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


class TaskSampler:
    """Builds N-way K-shot episodes from a character -> images index."""

    def __init__(self, dataset, ways, shots, query, rng):
        self.ds = dataset
        self.ways, self.shots, self.query = ways, shots, query
        self.rng = rng
        by_class = defaultdict(list)
        for idx, (_, label) in enumerate(dataset._flat_character_images):
            by_class[label].append(idx)
        self.classes = sorted(by_class)
        self.by_class = by_class

    def sample(self):
        chosen = self.rng.sample(self.classes, self.ways)
        rot = [self.rng.choice([0, 1, 2, 3]) for _ in chosen]  # rotations as new classes
        xs, ys, xq, yq = [], [], [], []
        for new_label, (c, k) in enumerate(zip(chosen, rot)):
            idxs = self.rng.sample(self.by_class[c], self.shots + self.query)
            imgs = [torch.rot90(self.ds[i][0], k, dims=(1, 2)) for i in idxs]
            xs += imgs[: self.shots]
            ys += [new_label] * self.shots
            xq += imgs[self.shots:]
            yq += [new_label] * self.query
        return torch.stack(xs), torch.tensor(ys), torch.stack(xq), torch.tensor(yq)


def adapt(model, xs, ys, args, rng):
    """Inner loop on a copy of the model; returns the adapted copy."""
    learner = copy.deepcopy(model)
    learner.train()
    opt = torch.optim.Adam(learner.parameters(), lr=args.inner_lr, betas=(0.0, 0.999))
    n = xs.size(0)
    for _ in range(args.inner_steps):
        idx = torch.tensor(rng.sample(range(n), min(args.inner_batch, n)), device=xs.device)
        loss = F.cross_entropy(learner(xs[idx]), ys[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return learner


def flat_params(model):
    return torch.cat([p.data.view(-1) for p in model.parameters()])


@torch.no_grad()
def set_flat(model, vec):
    offset = 0
    for p in model.parameters():
        n = p.numel()
        p.copy_(vec[offset: offset + n].view_as(p))
        offset += n


def meta_evaluate(model, sampler, args, device, rng):
    correct = torch.zeros(2, device=device)
    for _ in range(args.eval_tasks):
        xs, ys, xq, yq = [t.to(device) for t in sampler.sample()]
        learner = adapt(model, xs, ys, args, rng)
        with torch.no_grad():
            # transductive BatchNorm (query batch statistics), as in the Reptile paper
            pred = learner(xq).argmax(1)
        correct[0] += (pred == yq).sum()
        correct[1] += yq.numel()
    dist.all_reduce(correct)
    return (correct[0] / correct[1]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    # tasks are meant to differ between workers: seed the episode RNG per rank
    rng = random.Random(args.seed + 1000 * rank)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed + rank)

    tf = T.Compose([T.Resize(28), T.ToTensor(), lambda x: 1.0 - x])
    if rank == 0:
        Omniglot(args.root, background=True, download=True)
        Omniglot(args.root, background=False, download=True)
    dist.barrier()
    meta_train = Omniglot(args.root, background=True, transform=tf)
    meta_test = Omniglot(args.root, background=False, transform=tf)
    train_tasks = TaskSampler(meta_train, args.ways, args.shots, args.query, rng)
    test_tasks = TaskSampler(meta_test, args.ways, args.shots, args.query, rng)

    model = ConvNet(args.ways).to(device)
    theta = flat_params(model)
    dist.broadcast(theta, src=0)
    set_flat(model, theta)

    writer = SummaryWriter(args.logdir) if rank == 0 else None
    best = 0.0
    for it in range(args.meta_iters):
        frac = it / args.meta_iters
        meta_lr = args.meta_lr * (1.0 - frac)
        theta = flat_params(model)
        delta = torch.zeros_like(theta)
        for _ in range(args.meta_batch):
            xs, ys, _, _ = [t.to(device) for t in train_tasks.sample()]
            learner = adapt(model, xs, ys, args, rng)
            delta += flat_params(learner) - theta
        delta /= args.meta_batch
        dist.all_reduce(delta, op=dist.ReduceOp.SUM)
        delta /= world
        set_flat(model, theta + meta_lr * delta)

        if (it + 1) % args.eval_every == 0:
            acc = meta_evaluate(model, test_tasks, args, device, rng)
            if rank == 0:
                writer.add_scalar("meta_test/acc", acc, it + 1)
                writer.add_scalar("meta_lr", meta_lr, it + 1)
                print(f"iter {it + 1}: {args.ways}-way {args.shots}-shot acc {acc * 100:.2f}")
                state = {"model": model.state_dict(), "iter": it + 1, "args": vars(args)}
                torch.save(state, os.path.join(args.logdir, "reptile_last.pt"))
                if acc > best:
                    best = acc
                    torch.save(state, os.path.join(args.logdir, "reptile_best.pt"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
