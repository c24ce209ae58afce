#!/usr/bin/env python3
"""Second-order MAML on CIFAR-FS, meta-batch spread over GPUs.

DistributedDataParallel is not used: the inner loop runs several functional
forwards per task and differentiates through them, which does not fit DDP's
one-forward-one-backward reducer. Instead each rank back-propagates the outer
loss of its share of the meta-batch, the flattened meta-gradient is averaged
with a single all_reduce, and every rank takes the same Adam step.

    torchrun --nproc_per_node=4 09_maml_cifarfs_gradsync.py --data /data/cifar_fs --meta-batch 16
"""
import argparse
import logging
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parameters_to_vector, vector_to_parameters

log = logging.getLogger("maml")


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/cifar_fs")
    p.add_argument("--out", default="runs/maml_cifarfs")
    p.add_argument("--way", type=int, default=5)
    p.add_argument("--shot", type=int, default=5)
    p.add_argument("--query", type=int, default=15)
    p.add_argument("--meta-batch", type=int, default=16, help="tasks per outer step, summed over ranks")
    p.add_argument("--inner-steps", type=int, default=5)
    p.add_argument("--test-inner-steps", type=int, default=10)
    p.add_argument("--inner-lr", type=float, default=0.01)
    p.add_argument("--outer-lr", type=float, default=1e-3)
    p.add_argument("--steps", type=int, default=30000)
    p.add_argument("--eval-every", type=int, default=1000)
    p.add_argument("--eval-tasks", type=int, default=1000, help="summed over ranks")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class Split:
    """One CIFAR-FS split held in memory as float tensors [N, 3, 32, 32]."""

    MEAN = torch.tensor([0.5071, 0.4865, 0.4409]).view(1, 3, 1, 1)
    STD = torch.tensor([0.2673, 0.2564, 0.2762]).view(1, 3, 1, 1)

    def __init__(self, root, phase):
        with open(os.path.join(root, f"CIFAR_FS_{phase}.pickle"), "rb") as f:
            d = pickle.load(f, encoding="latin1")
        x = torch.from_numpy(d["data"]).permute(0, 3, 1, 2).float() / 255.0
        x = (x - self.MEAN) / self.STD
        labels = np.asarray(d["labels"])
        self.per_class = [x[torch.from_numpy(np.flatnonzero(labels == c))] for c in sorted(set(labels.tolist()))]

    def task(self, way, shot, query, gen):
        classes = torch.randperm(len(self.per_class), generator=gen)[:way].tolist()
        sx, qx = [], []
        for c in classes:
            imgs = self.per_class[c]
            sel = torch.randperm(imgs.size(0), generator=gen)[: shot + query]
            sx.append(imgs[sel[:shot]])
            qx.append(imgs[sel[shot:]])
        return (torch.cat(sx), torch.arange(way).repeat_interleave(shot),
                torch.cat(qx), torch.arange(way).repeat_interleave(query))


def conv_bn(cin, cout):
    # track_running_stats=False: MAML normalises with the statistics of each task's batch
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout, track_running_stats=False),
                         nn.ReLU(), nn.MaxPool2d(2))


class MAMLConvNet(nn.Module):
    def __init__(self, way, hid=64):
        super().__init__()
        self.body = nn.Sequential(conv_bn(3, hid), conv_bn(hid, hid), conv_bn(hid, hid), conv_bn(hid, hid))
        self.head = nn.Linear(hid * 2 * 2, way)

    def forward(self, x, params=None):
        if params is None:
            return self.head(self.body(x).flatten(1))
        return torch.func.functional_call(self, params, (x,))


def inner_adapt(model, xs, ys, steps, lr, second_order):
    params = dict(model.named_parameters())
    for _ in range(steps):
        loss = F.cross_entropy(model(xs, params), ys)
        grads = torch.autograd.grad(loss, params.values(), create_graph=second_order)
        params = {k: v - lr * g for (k, v), g in zip(params.items(), grads)}
    return params


def sync_meta_grads(model, world):
    params = [p for p in model.parameters()]
    flat = parameters_to_vector([p.grad for p in params])
    dist.all_reduce(flat)
    flat /= world
    vector_to_parameters(flat, [p.grad for p in params])


def evaluate(model, split, args, n_tasks, gen, device):
    hits = torch.zeros(2, device=device, dtype=torch.float64)
    for _ in range(n_tasks):
        xs, ys, xq, yq = (t.to(device) for t in split.task(args.way, args.shot, args.query, gen))
        fast = inner_adapt(model, xs, ys, args.test_inner_steps, args.inner_lr, second_order=False)
        with torch.no_grad():
            pred = model(xq, fast).argmax(1)
        hits += torch.tensor([(pred == yq).sum().item(), yq.numel()], device=device, dtype=torch.float64)
    dist.all_reduce(hits)
    return (hits[0] / hits[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    if args.meta_batch % world:
        raise ValueError(f"--meta-batch {args.meta_batch} is not divisible by world size {world}")
    local_tasks = args.meta_batch // world

    train, val = Split(args.data, "train"), Split(args.data, "val")
    # identical initial weights on all ranks; independent task streams per rank
    torch.manual_seed(args.seed)
    model = MAMLConvNet(args.way).to(device)
    task_gen = torch.Generator().manual_seed(args.seed + 1 + rank)

    opt = torch.optim.Adam(model.parameters(), lr=args.outer_lr)
    start = 0
    ckpt_file = os.path.join(args.out, "checkpoint.pt")
    if os.path.isfile(ckpt_file):
        ck = torch.load(ckpt_file, map_location="cpu")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        task_gen.manual_seed(args.seed + 1 + rank + 7 * ck["step"])
        start = ck["step"]
        log.info("resumed at step %d", start)

    window = torch.zeros(3, device=device)
    tic = time.time()
    for step in range(start, args.steps):
        opt.zero_grad(set_to_none=True)
        for _ in range(local_tasks):
            xs, ys, xq, yq = (t.to(device, non_blocking=True)
                              for t in train.task(args.way, args.shot, args.query, task_gen))
            fast = inner_adapt(model, xs, ys, args.inner_steps, args.inner_lr, second_order=True)
            logits = model(xq, fast)
            loss = F.cross_entropy(logits, yq)
            (loss / local_tasks).backward()
            window += torch.stack([loss.detach(), (logits.argmax(1) == yq).float().mean(),
                                   torch.ones((), device=device)])
        sync_meta_grads(model, world)
        opt.step()

        if (step + 1) % 200 == 0:
            dist.all_reduce(window)
            log.info("step %d  outer loss %.4f  query acc %.4f  (%.1f s)", step + 1,
                     (window[0] / window[2]).item(), (window[1] / window[2]).item(), time.time() - tic)
            window.zero_()

        if (step + 1) % args.eval_every == 0:
            eval_gen = torch.Generator().manual_seed(10_000 + rank)
            acc = evaluate(model, val, args, args.eval_tasks // world, eval_gen, device)
            log.info("step %d  val acc %.2f%%", step + 1, 100 * acc)
            if rank == 0:
                os.makedirs(args.out, exist_ok=True)
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1,
                            "val_acc": acc, "args": vars(args)}, ckpt_file + ".tmp")
                os.replace(ckpt_file + ".tmp", ckpt_file)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
