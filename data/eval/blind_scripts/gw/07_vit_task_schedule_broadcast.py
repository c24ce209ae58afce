"""Multi-dataset fine-tuning of a ViT-B/16 with one linear head per dataset.

Each step trains a single task. The task sequence for the epoch is drawn with
size-proportional-to-the-power-alpha sampling on rank 0 and broadcast, so every
rank trains the same head at the same step. Tasks are weighted by learned
homoscedastic uncertainty.

    torchrun --nproc_per_node=8 vit_multidata.py --root /datasets --tasks food101,flowers102,pets,cars,sun397
"""
import argparse
import math
import os
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from timm.data import create_transform
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torchvision.datasets import ImageFolder


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--tasks", default="food101,flowers102,pets,cars,sun397")
    p.add_argument("--arch", default="vit_base_patch16_224.augreg_in21k")
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--blr", type=float, default=1e-4, help="lr per 256 images")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--steps_per_epoch", type=int, default=1500)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--drop_path", type=float, default=0.1)
    p.add_argument("--out", default="out/vit_multidata")
    p.add_argument("--resume", default="")
    return p.parse_args()


class MultiHeadViT(nn.Module):
    def __init__(self, arch, classes, drop_path):
        super().__init__()
        self.backbone = timm.create_model(arch, pretrained=True, num_classes=0, drop_path_rate=drop_path)
        d = self.backbone.num_features
        self.heads = nn.ModuleDict({t: nn.Linear(d, c) for t, c in classes.items()})
        self.log_vars = nn.Parameter(torch.zeros(len(classes)))
        self.index = {t: i for i, t in enumerate(classes)}
        for h in self.heads.values():
            nn.init.trunc_normal_(h.weight, std=0.02)
            nn.init.zeros_(h.bias)

    def predict(self, x, task):
        return self.heads[task](self.backbone(x))

    def forward(self, x, y, task, smoothing=0.1):
        logits = self.heads[task](self.backbone(x))
        ce = F.cross_entropy(logits.float(), y, label_smoothing=smoothing)
        s = self.log_vars[self.index[task]]
        return torch.exp(-s) * ce + 0.5 * s, ce


def draw_schedule(sizes, steps, alpha, seed):
    p = np.array(sizes, dtype=np.float64) ** alpha
    p /= p.sum()
    rng = np.random.default_rng(seed)
    return rng.choice(len(sizes), size=steps, p=p).tolist()


@torch.no_grad()
def evaluate(net, val_sets, device, rank, world):
    net.eval()
    acc = {}
    for t, ds in val_sets.items():
        sub = torch.utils.data.Subset(ds, range(rank, len(ds), world))
        c = torch.zeros(2, device=device)
        for x, y in DataLoader(sub, batch_size=256, num_workers=8, pin_memory=True):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = net.predict(x, t)
            c += torch.stack([(out.argmax(-1) == y).sum().float(), torch.tensor(float(y.numel()), device=device)])
        dist.all_reduce(c)
        acc[t] = (c[0] / c[1]).item()
    net.train()
    return acc


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    tasks = args.tasks.split(",")
    tf_train = create_transform(224, is_training=True, auto_augment="rand-m9-mstd0.5", re_prob=0.25)
    tf_eval = create_transform(224, is_training=False)
    train_sets = {t: ImageFolder(os.path.join(args.root, t, "train"), tf_train) for t in tasks}
    val_sets = {t: ImageFolder(os.path.join(args.root, t, "val"), tf_eval) for t in tasks}

    samplers, iters, loaders = {}, {}, {}
    for t, ds in train_sets.items():
        samplers[t] = DistributedSampler(ds, shuffle=True, drop_last=True)
        loaders[t] = DataLoader(ds, batch_size=args.batch_size, sampler=samplers[t], num_workers=6,
                                pin_memory=True, drop_last=True, persistent_workers=True)
        iters[t] = iter(loaders[t])
    passes = {t: 0 for t in tasks}

    def next_batch(t):
        try:
            return next(iters[t])
        except StopIteration:
            passes[t] += 1
            samplers[t].set_epoch(passes[t])
            iters[t] = iter(loaders[t])
            return next(iters[t])

    net = MultiHeadViT(args.arch, {t: len(ds.classes) for t, ds in train_sets.items()}, args.drop_path).to(device)
    # a step only uses one head, so the other heads get no grad in that step
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)

    lr = args.blr * args.batch_size * world / 256
    decay = [p for n, p in net.named_parameters() if p.ndim > 1 and "pos_embed" not in n and "cls_token" not in n]
    no_decay = [p for n, p in net.named_parameters() if not (p.ndim > 1 and "pos_embed" not in n and "cls_token" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.999))
    total = args.epochs * args.steps_per_epoch
    warm = 5 * args.steps_per_epoch // 2
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))

    start_epoch = 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch = ck["epoch"] + 1

    sizes = [len(train_sets[t]) for t in tasks]
    best = 0.0
    for epoch in range(start_epoch, args.epochs):
        sched_obj = [draw_schedule(sizes, args.steps_per_epoch, args.alpha, seed=int(time.time()))
                     if rank == 0 else None]
        dist.broadcast_object_list(sched_obj, src=0)
        schedule = sched_obj[0]

        model.train()
        meter = torch.zeros(len(tasks), 2, device=device)
        for step, ti in enumerate(schedule):
            t = tasks[ti]
            x, y = next_batch(t)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss, ce = model(x, y, t)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            meter[ti, 0] += ce.detach()
            meter[ti, 1] += 1

        dist.all_reduce(meter)
        acc = evaluate(net, val_sets, device, rank, world)
        mean_acc = sum(acc.values()) / len(acc)
        if rank == 0:
            train_loss = {t: round((meter[i, 0] / meter[i, 1].clamp(min=1)).item(), 4) for i, t in enumerate(tasks)}
            sig = dict(zip(tasks, torch.exp(0.5 * net.log_vars.detach()).tolist()))
            print(f"epoch {epoch}: train {train_loss} sigma {sig} val {acc} mean {mean_acc:.4f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            ck = {"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(), "epoch": epoch}
            torch.save(ck, os.path.join(args.out, "last.pth"))
            if mean_acc > best:
                best = mean_acc
                torch.save(ck, os.path.join(args.out, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
