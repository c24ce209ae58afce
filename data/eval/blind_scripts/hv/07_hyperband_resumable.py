"""Resumable Hyperband over (lr, weight decay, mixup) for a trimmed ResNet-50 on Food-101.

Each trial's weights are checkpointed to the shared sweep directory after each
rung, so promoted trials continue where they stopped and the whole sweep can be
restarted after a preemption (the sweep state lives in sweep_state.json).

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29400 \
        07_hyperband_resumable.py --data /nfs/datasets/food-101 --sweep-dir /nfs/sweeps/food_hb
"""
import argparse
import json
import math
import os
import random
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Sampler, Subset
from torchvision import datasets, models, transforms


class ShardedEpochSampler(Sampler):
    """Same permutation on every rank (seeded by epoch), each rank takes a strided shard.

    The permutation is cut to a multiple of world_size so all ranks get the same count.
    """

    def __init__(self, n, rank, world, seed=0):
        self.n, self.rank, self.world, self.seed = n, rank, world, seed
        self.epoch = 0
        self.per_rank = n // world

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        perm = torch.randperm(self.n, generator=g)[: self.per_rank * self.world]
        return iter(perm[self.rank::self.world].tolist())

    def __len__(self):
        return self.per_rank


def sample_trial(rng, tid):
    return {"id": tid, "lr": 10 ** rng.uniform(-2, -0.3), "wd": 10 ** rng.uniform(-5, -3),
            "mixup": rng.choice([0.0, 0.2, 0.4]), "epochs_done": 0, "score": None}


def hyperband_schedule(max_epochs, eta):
    s_max = int(math.log(max_epochs) / math.log(eta) + 1e-9)
    brackets = []
    for s in reversed(range(s_max + 1)):
        n = int(math.ceil((s_max + 1) / (s + 1) * eta ** s))
        r = max_epochs * eta ** (-s)
        brackets.append([(int(n * eta ** (-i)), int(round(r * eta ** i))) for i in range(s + 1)])
    return brackets


def build_model():
    m = models.resnet50(num_classes=101)
    m.layer4 = nn.Identity()  # drop the last stage to fit the sweep budget
    m.fc = nn.Linear(1024, 101)
    return m


def train_epochs(trial, target_epochs, args, data, device, local_rank, rank, world):
    train_set, val_set = data
    model = build_model()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    ckpt_path = os.path.join(args.sweep_dir, f"trial_{trial['id']:03d}.pt")
    opt = torch.optim.SGD(model.parameters(), lr=trial["lr"], momentum=0.9, weight_decay=trial["wd"])
    start = trial["epochs_done"]
    if start > 0:
        ckpt = torch.load(ckpt_path, map_location=device)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
    model = DDP(model, device_ids=[local_rank])

    sampler = ShardedEpochSampler(len(train_set), rank, world, seed=args.seed)
    micro = args.global_batch // (world * args.accum)
    loader = DataLoader(train_set, micro, sampler=sampler, num_workers=args.workers, pin_memory=True,
                        drop_last=True)
    steps_per_epoch = len(loader) // args.accum
    total = args.max_epochs * steps_per_epoch
    crit = nn.CrossEntropyLoss()

    for epoch in range(start, target_epochs):
        sampler.set_epoch(epoch)
        model.train()
        for i, (x, y) in enumerate(loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if trial["mixup"] > 0:
                lam = np.random.beta(trial["mixup"], trial["mixup"])
                idx = torch.randperm(x.size(0), device=device)
                x = lam * x + (1 - lam) * x[idx]
            boundary = (i + 1) % args.accum == 0
            with model.no_sync() if not boundary else nullcontext():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out = model(x)
                    loss = crit(out, y) if trial["mixup"] == 0 else lam * crit(out, y) + (1 - lam) * crit(out, y[idx])
                (loss / args.accum).backward()
            if boundary:
                step = epoch * steps_per_epoch + (i + 1) // args.accum
                for g in opt.param_groups:
                    g["lr"] = trial["lr"] * 0.5 * (1 + math.cos(math.pi * step / total))
                opt.step()
                opt.zero_grad(set_to_none=True)

    score = evaluate(model, val_set, args, device, rank, world)
    if rank == 0:
        tmp = ckpt_path + ".tmp"
        torch.save({"model": model.module.state_dict(), "opt": opt.state_dict()}, tmp)
        os.replace(tmp, ckpt_path)
    dist.barrier()
    del model, opt, loader
    torch.cuda.empty_cache()
    return score


@torch.no_grad()
def evaluate(model, val_set, args, device, rank, world):
    model.eval()
    shard = Subset(val_set, range(rank, len(val_set), world))
    loader = DataLoader(shard, 256, num_workers=args.workers, pin_memory=True)
    c = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            c[0] += (model(x).argmax(1) == y).sum()
        c[1] += y.numel()
    dist.all_reduce(c)
    return (c[0] / c[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--sweep-dir", required=True, help="must be on storage shared by all nodes")
    ap.add_argument("--max-epochs", type=int, default=27)
    ap.add_argument("--eta", type=int, default=3)
    ap.add_argument("--global-batch", type=int, default=1024)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--seed", type=int, default=17)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    norm = transforms.Normalize([0.55, 0.44, 0.34], [0.23, 0.24, 0.24])
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), transforms.Compose([
        transforms.RandomResizedCrop(160), transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm]))
    val_set = datasets.ImageFolder(os.path.join(args.data, "test"), transforms.Compose([
        transforms.Resize(184), transforms.CenterCrop(160), transforms.ToTensor(), norm]))

    state_path = os.path.join(args.sweep_dir, "sweep_state.json")
    state = [None]
    if rank == 0:
        os.makedirs(args.sweep_dir, exist_ok=True)
        if os.path.exists(state_path):
            with open(state_path) as f:
                state[0] = json.load(f)
        else:
            rng = random.Random(args.seed)
            brackets, tid = [], 0
            for rungs in hyperband_schedule(args.max_epochs, args.eta):
                n0 = rungs[0][0]
                brackets.append({"rungs": rungs, "rung": 0,
                                 "trials": [sample_trial(rng, tid + k) for k in range(n0)]})
                tid += n0
            state[0] = {"brackets": brackets}
    dist.broadcast_object_list(state, src=0)
    state = state[0]

    for b in state["brackets"]:
        while b["rung"] < len(b["rungs"]):
            n_keep, epochs = b["rungs"][b["rung"]]
            live = sorted(b["trials"], key=lambda t: -(t["score"] or 0.0))[:n_keep] if b["rung"] else b["trials"]
            for t in live:
                if t["epochs_done"] >= epochs:
                    continue
                t["score"] = train_epochs(t, epochs, args, (train_set, val_set), device, local_rank, rank, world)
                t["epochs_done"] = epochs
                if rank == 0:
                    print(f"trial {t['id']} @ {epochs} ep: acc {t['score']:.4f}", flush=True)
                    with open(state_path + ".tmp", "w") as f:
                        json.dump(state, f)
                    os.replace(state_path + ".tmp", state_path)
            b["trials"] = live
            b["rung"] += 1

    if rank == 0:
        best = max((t for b in state["brackets"] for t in b["trials"]), key=lambda t: t["score"] or 0.0)
        print("best trial:", best, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
