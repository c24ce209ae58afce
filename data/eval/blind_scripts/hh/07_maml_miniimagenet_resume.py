#!/usr/bin/env python3
"""MAML (Finn et al. 2017) on miniImageNet, 5-way, tasks spread over GPUs.

The meta-batch of tasks is split across ranks. Each rank computes the meta-gradient
of its tasks with torch.func.functional_call; the gradients are then averaged with
all_reduce before the shared Adam step (the same scheme learn2learn's distributed
examples use). Long runs are resumed from --resume.

    torchrun --nproc_per_node=4 07_maml_miniimagenet_resume.py --data /data/miniImageNet \
        --resume runs/maml5w1s/ckpt_latest.pt
"""
import argparse
import json
import os
import time
from collections import OrderedDict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.func import functional_call
from torchvision import transforms


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/miniImageNet")
    ap.add_argument("--out", default="runs/maml5w1s")
    ap.add_argument("--resume", default="")
    ap.add_argument("--ways", type=int, default=5)
    ap.add_argument("--shots", type=int, default=1)
    ap.add_argument("--queries", type=int, default=15)
    ap.add_argument("--meta-batch", type=int, default=4, help="tasks per meta-update (all GPUs)")
    ap.add_argument("--inner-steps", type=int, default=5)
    ap.add_argument("--inner-steps-test", type=int, default=10)
    ap.add_argument("--inner-lr", type=float, default=0.01)
    ap.add_argument("--meta-lr", type=float, default=1e-3)
    ap.add_argument("--iterations", type=int, default=60000)
    ap.add_argument("--first-order", action="store_true")
    ap.add_argument("--val-every", type=int, default=500)
    ap.add_argument("--val-tasks", type=int, default=600)
    ap.add_argument("--seed", type=int, default=7)
    return ap.parse_args()


class TaskSampler:
    """Loads one split into memory (84x84 uint8) and draws N-way K-shot tasks."""

    def __init__(self, root, split, seed):
        tf = transforms.Compose([transforms.Resize((84, 84)), transforms.PILToTensor()])
        rows = [l.strip().split(",") for l in open(os.path.join(root, f"{split}.csv")).readlines()[1:]]
        by_class = OrderedDict()
        for fname, wnid in rows:
            by_class.setdefault(wnid, []).append(fname)
        self.images = []
        for wnid, files in by_class.items():
            self.images.append(torch.stack([tf(Image.open(os.path.join(root, "images", f)).convert("RGB"))
                                            for f in files]))
        self.rng = np.random.RandomState(seed)
        self.mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
        self.std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)

    def sample(self, ways, shots, queries):
        classes = self.rng.choice(len(self.images), ways, replace=False)
        xs, xq = [], []
        for c in classes:
            idx = self.rng.choice(self.images[c].size(0), shots + queries, replace=False)
            imgs = (self.images[c][idx].float() / 255.0 - self.mean) / self.std
            xs.append(imgs[:shots])
            xq.append(imgs[shots:])
        ys = torch.arange(ways).repeat_interleave(shots)
        yq = torch.arange(ways).repeat_interleave(queries)
        return torch.cat(xs), ys, torch.cat(xq), yq


class ConvNet(nn.Module):
    def __init__(self, ways, hidden=32):
        super().__init__()
        layers, cin = [], 3
        for _ in range(4):
            layers += [nn.Conv2d(cin, hidden, 3, padding=1),
                       nn.BatchNorm2d(hidden, track_running_stats=False),
                       nn.ReLU(inplace=True),
                       nn.MaxPool2d(2)]
            cin = hidden
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(hidden * 5 * 5, ways)

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


def adapt_and_eval(model, params, task, steps, inner_lr, create_graph):
    xs, ys, xq, yq = task
    fast = OrderedDict(params)
    for _ in range(steps):
        loss = F.cross_entropy(functional_call(model, fast, (xs,)), ys)
        grads = torch.autograd.grad(loss, list(fast.values()), create_graph=create_graph)
        fast = OrderedDict((n, w - inner_lr * g) for (n, w), g in zip(fast.items(), grads))
    logits = functional_call(model, fast, (xq,))
    return F.cross_entropy(logits, yq), (logits.argmax(1) == yq).float().mean()


def average_gradients(model, world_size):
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad.div_(world_size)


def to_device(task, device):
    return tuple(t.to(device, non_blocking=True) for t in task)


def meta_validate(model, sampler, args, n_tasks, device):
    params = OrderedDict(model.named_parameters())
    acc = torch.zeros(2, device=device)
    for _ in range(n_tasks):
        task = to_device(sampler.sample(args.ways, args.shots, args.queries), device)
        _, a = adapt_and_eval(model, params, task, args.inner_steps_test, args.inner_lr, create_graph=False)
        acc += torch.stack([a.detach(), torch.ones_like(a)])
    dist.all_reduce(acc)
    return (acc[0] / acc[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    assert args.meta_batch % world == 0
    tasks_per_rank = args.meta_batch // world

    torch.manual_seed(args.seed)
    train_tasks = TaskSampler(args.data, "train", seed=args.seed + 1000 * rank)
    val_tasks = TaskSampler(args.data, "val", seed=args.seed + 1000 * rank + 1)

    model = ConvNet(args.ways).to(device)
    meta_opt = torch.optim.Adam(model.parameters(), lr=args.meta_lr)
    start_it = 0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume)
        model.load_state_dict(ckpt["model"])
        meta_opt.load_state_dict(ckpt["meta_opt"])
        start_it = ckpt["iteration"]
        if rank == 0:
            print(f"resumed from {args.resume} at iteration {start_it}")
    for p in model.parameters():
        dist.broadcast(p.data, 0)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)
    log_buf = torch.zeros(3, device=device)
    tic = time.time()

    for it in range(start_it, args.iterations):
        model.train()
        meta_opt.zero_grad(set_to_none=True)
        params = OrderedDict(model.named_parameters())
        for _ in range(tasks_per_rank):
            task = to_device(train_tasks.sample(args.ways, args.shots, args.queries), device)
            loss, acc = adapt_and_eval(model, params, task, args.inner_steps, args.inner_lr,
                                       create_graph=not args.first_order)
            (loss / tasks_per_rank).backward()
            log_buf += torch.stack([loss.detach(), acc.detach(), torch.ones_like(acc)])
        average_gradients(model, world)
        meta_opt.step()

        if (it + 1) % 100 == 0:
            dist.all_reduce(log_buf)
            if rank == 0:
                print(f"it {it + 1} loss {(log_buf[0] / log_buf[2]).item():.4f} "
                      f"acc {(log_buf[1] / log_buf[2]).item():.4f} {time.time() - tic:.0f}s", flush=True)
            log_buf.zero_()

        if (it + 1) % args.val_every == 0:
            val_acc = meta_validate(model, val_tasks, args, args.val_tasks // world, device)
            if rank == 0:
                print(f"it {it + 1} val acc {val_acc:.4f}", flush=True)
                torch.save({"model": model.state_dict(), "meta_opt": meta_opt.state_dict(),
                            "iteration": it + 1, "val_acc": val_acc},
                           os.path.join(args.out, "ckpt_latest.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
