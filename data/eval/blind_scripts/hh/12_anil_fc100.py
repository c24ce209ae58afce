#!/usr/bin/env python3
"""ANIL (Raghu et al. 2020): MAML with the inner loop restricted to the linear head.

FC100 (CIFAR-100 split by super-class). The backbone features of a task are
computed once; only the head is adapted functionally, which makes second-order
meta-gradients cheap. Tasks of the meta-batch are divided among the ranks and the
meta-gradients are all-reduced by hand.

    torchrun --nproc_per_node=4 12_anil_fc100.py --data /data/FC100 --shots 5
"""
import argparse
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/FC100")
    p.add_argument("--out", default="runs/anil_fc100")
    p.add_argument("--ways", type=int, default=5)
    p.add_argument("--shots", type=int, default=5)
    p.add_argument("--queries", type=int, default=10)
    p.add_argument("--meta-batch", type=int, default=32, help="total over ranks")
    p.add_argument("--adapt-steps", type=int, default=10)
    p.add_argument("--adapt-lr", type=float, default=0.1)
    p.add_argument("--meta-lr", type=float, default=3e-3)
    p.add_argument("--iterations", type=int, default=20000)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--eval-tasks", type=int, default=1024)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--wandb-project", default=None)
    return p.parse_args()


def init_distributed():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return dist.get_rank(), dist.get_world_size(), local_rank


class FC100:
    def __init__(self, root, split):
        with open(os.path.join(root, f"FC100_{split}.pickle"), "rb") as f:
            d = pickle.load(f, encoding="latin1")
        x = torch.from_numpy(d["data"]).permute(0, 3, 1, 2).contiguous()  # uint8 [N,3,32,32]
        y = np.asarray(d["labels"])
        self.classes = [x[torch.from_numpy(np.flatnonzero(y == c))] for c in np.unique(y)]
        self.mean = torch.tensor([0.5071, 0.4866, 0.4409]).view(1, 3, 1, 1)
        self.std = torch.tensor([0.2009, 0.1984, 0.2023]).view(1, 3, 1, 1)

    def sample_task(self, ways, shots, queries, rng):
        cls = rng.choice(len(self.classes), ways, replace=False)
        support, query = [], []
        for c in cls:
            imgs = self.classes[c]
            idx = torch.from_numpy(rng.choice(imgs.size(0), shots + queries, replace=False))
            sel = (imgs[idx].float() / 255.0 - self.mean) / self.std
            support.append(sel[:shots])
            query.append(sel[shots:])
        return (torch.cat(support), torch.arange(ways).repeat_interleave(shots),
                torch.cat(query), torch.arange(ways).repeat_interleave(queries))


class CifarCNN(nn.Module):
    """4 conv blocks, 64 channels, as in the learn2learn ANIL FC100 example (no pooling in blocks 3-4)."""

    def __init__(self, hid=64):
        super().__init__()

        def block(cin, cout, pool):
            mods = [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout, track_running_stats=False), nn.ReLU()]
            if pool:
                mods.append(nn.MaxPool2d(2))
            return nn.Sequential(*mods)

        self.features = nn.Sequential(block(3, hid, True), block(hid, hid, True),
                                      block(hid, hid, True), block(hid, hid, False))
        self.out_dim = hid * 4 * 4

    def forward(self, x):
        return self.features(x).flatten(1)


def head_forward(feats, w, b):
    return F.linear(feats, w, b)


def fast_adapt(body, head, task, steps, lr, device, second_order=True):
    xs, ys, xq, yq = (t.to(device, non_blocking=True) for t in task)
    feats = body(torch.cat([xs, xq]))
    fs, fq = feats[: xs.size(0)], feats[xs.size(0):]
    w, b = head.weight, head.bias
    for _ in range(steps):
        loss = F.cross_entropy(head_forward(fs, w, b), ys)
        gw, gb = torch.autograd.grad(loss, (w, b), create_graph=second_order)
        w, b = w - lr * gw, b - lr * gb
    logits = head_forward(fq, w, b)
    return F.cross_entropy(logits, yq), (logits.argmax(1) == yq).float().mean()


def allreduce_grads(params, world):
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat.div_(world)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def main():
    args = get_args()
    rank, world, local_rank = init_distributed()
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    assert args.meta_batch % world == 0
    local_bs = args.meta_batch // world

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        if args.wandb_project:
            wandb.init(project=args.wandb_project, config=vars(args), name=os.path.basename(args.out))

    train, val = FC100(args.data, "train"), FC100(args.data, "val")
    rng = np.random.RandomState(args.seed + rank)
    torch.manual_seed(args.seed)
    body = CifarCNN().to(device)
    head = nn.Linear(body.out_dim, args.ways).to(device)
    params = list(body.parameters()) + list(head.parameters())
    for p in params:
        dist.broadcast(p.data, src=0)
    opt = torch.optim.Adam(params, lr=args.meta_lr)

    tic = time.time()
    for it in range(1, args.iterations + 1):
        opt.zero_grad()
        stats = torch.zeros(2, device=device)
        for _ in range(local_bs):
            task = train.sample_task(args.ways, args.shots, args.queries, rng)
            loss, acc = fast_adapt(body, head, task, args.adapt_steps, args.adapt_lr, device)
            (loss / local_bs).backward()
            stats += torch.stack([loss.detach(), acc]) / local_bs
        allreduce_grads(params, world)
        opt.step()

        if it % 50 == 0:
            dist.all_reduce(stats)
            stats /= world
            if rank == 0:
                print(f"iter {it} loss {stats[0].item():.4f} acc {stats[1].item():.4f} "
                      f"({time.time() - tic:.0f}s)", flush=True)
                if args.wandb_project:
                    wandb.log({"train/loss": stats[0].item(), "train/acc": stats[1].item()}, step=it)

        if it % args.eval_every == 0:
            vrng = np.random.RandomState(777 + rank)
            val_acc = torch.zeros(1, device=device)
            n_local = args.eval_tasks // world
            for _ in range(n_local):
                _, acc = fast_adapt(body, head, val.sample_task(args.ways, args.shots, args.queries, vrng),
                                    args.adapt_steps, args.adapt_lr, device, second_order=False)
                val_acc += acc.detach()
            dist.all_reduce(val_acc)
            val_acc = val_acc.item() / (n_local * world)
            if rank == 0:
                print(f"iter {it} val acc {val_acc:.4f}", flush=True)
                if args.wandb_project:
                    wandb.log({"val/acc": val_acc}, step=it)
                torch.save({"body": body.state_dict(), "head": head.state_dict(), "opt": opt.state_dict(),
                            "iteration": it}, os.path.join(args.out, f"anil_{it:06d}.pt"))

    if rank == 0 and args.wandb_project:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
