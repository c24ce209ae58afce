#!/usr/bin/env python3
"""Reptile (Nichol et al. 2018) on mini-ImageNet, one task per GPU per meta-step.

Each rank adapts a copy of the weights on its own task with plain SGD/Adam,
then the per-task updates (phi - theta) are averaged over all ranks.

    torchrun --nnodes=1 --nproc_per_node=8 06_reptile_miniimagenet.py \
        --data /shared/datasets/miniimagenet --out /shared/exp/reptile_mini
"""
import argparse
import copy
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchvision.datasets import ImageFolder
from torchvision import transforms


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="folder with train/ val/ test/ subfolders")
    p.add_argument("--out", required=True)
    p.add_argument("--ways", type=int, default=5)
    p.add_argument("--shots", type=int, default=5)
    p.add_argument("--inner-batch", type=int, default=10)
    p.add_argument("--inner-iters", type=int, default=8)
    p.add_argument("--inner-lr", type=float, default=1e-3)
    p.add_argument("--eval-inner-iters", type=int, default=50)
    p.add_argument("--meta-step", type=float, default=1.0)
    p.add_argument("--meta-step-final", type=float, default=0.0)
    p.add_argument("--meta-iters", type=int, default=100000)
    p.add_argument("--eval-every", type=int, default=1000)
    p.add_argument("--eval-tasks", type=int, default=400)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class TaskSampler:
    """Draws N-way K-shot tasks from an ImageFolder, keeping the images in RAM (uint8)."""

    def __init__(self, root, rng):
        tf = transforms.Compose([transforms.Resize((84, 84)), transforms.PILToTensor()])
        folder = ImageFolder(root, transform=tf)
        self.by_class = {}
        loader = DataLoader(folder, batch_size=256, num_workers=4)
        xs, ys = zip(*[(x, y) for x, y in loader])
        xs, ys = torch.cat(xs), torch.cat(ys)
        for c in ys.unique().tolist():
            self.by_class[c] = xs[ys == c]
        self.rng = rng

    def sample(self, ways, shots, n_query=0):
        classes = self.rng.sample(sorted(self.by_class), ways)
        xs, ys, xq, yq = [], [], [], []
        for label, c in enumerate(classes):
            imgs = self.by_class[c]
            idx = self.rng.sample(range(len(imgs)), shots + n_query)
            xs.append(imgs[idx[:shots]])
            ys += [label] * shots
            if n_query:
                xq.append(imgs[idx[shots:]])
                yq += [label] * n_query
        support = (torch.cat(xs).float() / 255, torch.tensor(ys))
        query = (torch.cat(xq).float() / 255, torch.tensor(yq)) if n_query else None
        return support, query


class MiniImageNetModel(nn.Module):
    def __init__(self, ways):
        super().__init__()
        layers = []
        for i in range(4):
            layers += [nn.Conv2d(3 if i == 0 else 32, 32, 3, padding=1),
                       nn.BatchNorm2d(32, track_running_stats=False), nn.ReLU(), nn.MaxPool2d(2)]
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(32 * 5 * 5, ways)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def inner_train(model, support, iters, batch, lr, device, rng):
    x, y = support[0].to(device), support[1].to(device)
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0, 0.999))
    model.train()
    for _ in range(iters):
        idx = torch.tensor(rng.sample(range(len(x)), min(batch, len(x))))
        loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()


def evaluate(model, sampler, args, device, rng, n_tasks):
    world = dist.get_world_size()
    correct = torch.zeros(2, device=device)
    accs = []
    for _ in range(n_tasks // world):
        learner = copy.deepcopy(model)
        support, query = sampler.sample(args.ways, args.shots, n_query=1)
        inner_train(learner, support, args.eval_inner_iters, args.inner_batch, args.inner_lr,
                    device, rng)
        with torch.no_grad():
            pred = learner(query[0].to(device)).argmax(1).cpu()
        accs.append((pred == query[1]).float().mean().item())
    local = torch.tensor([sum(accs), sum(a * a for a in accs), len(accs)], device=device)
    dist.all_reduce(local)
    mean = (local[0] / local[2]).item()
    std = max((local[1] / local[2]).item() - mean ** 2, 0.0) ** 0.5
    return mean, 1.96 * std / local[2].item() ** 0.5


def save_checkpoint(path, model, meta_opt, it, best):
    torch.save({"model": model.state_dict(), "meta_opt": meta_opt.state_dict(),
                "iteration": it, "best": best}, path)


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed * 1000 + rank)

    train_tasks = TaskSampler(os.path.join(args.data, "train"), rng)
    val_tasks = TaskSampler(os.path.join(args.data, "val"), random.Random(99 + rank))

    model = MiniImageNetModel(args.ways).to(device)
    # plain SGD on the averaged (theta - phi) implements theta += eps * (phi - theta)
    meta_opt = torch.optim.SGD(model.parameters(), lr=args.meta_step)
    os.makedirs(args.out, exist_ok=True)
    ckpt_path = os.path.join(args.out, "reptile.pt")

    start, best = 0, 0.0
    if args.resume and os.path.exists(ckpt_path):
        state = torch.load(ckpt_path, map_location=device)
        model.load_state_dict(state["model"])
        meta_opt.load_state_dict(state["meta_opt"])
        start, best = state["iteration"] + 1, state["best"]
    for p in model.parameters():
        dist.broadcast(p.data, src=0)

    t0 = time.time()
    for it in range(start, args.meta_iters):
        frac = it / args.meta_iters
        for g in meta_opt.param_groups:
            g["lr"] = frac * args.meta_step_final + (1 - frac) * args.meta_step

        learner = copy.deepcopy(model)
        support, _ = train_tasks.sample(args.ways, args.shots)
        inner_train(learner, support, args.inner_iters, args.inner_batch, args.inner_lr, device, rng)

        diffs = [p.data - q.data for p, q in zip(model.parameters(), learner.parameters())]
        flat = torch.cat([d.view(-1) for d in diffs])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat /= world
        offset = 0
        for p, d in zip(model.parameters(), diffs):
            p.grad = flat[offset:offset + d.numel()].view_as(p).clone()
            offset += d.numel()
        meta_opt.step()
        meta_opt.zero_grad(set_to_none=True)

        if (it + 1) % args.eval_every == 0:
            acc, ci = evaluate(model, val_tasks, args, device, rng, args.eval_tasks)
            if rank == 0:
                print(f"[{it + 1}] val acc {100 * acc:.2f} +- {100 * ci:.2f} "
                      f"({(time.time() - t0) / args.eval_every:.3f}s/it)", flush=True)
                t0 = time.time()
            if acc > best:
                best = acc
                torch.save(model.state_dict(), os.path.join(args.out, "best_model.pt"))
            save_checkpoint(ckpt_path, model, meta_opt, it, best)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
