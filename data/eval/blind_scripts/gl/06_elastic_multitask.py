#!/usr/bin/env python3
"""Elastic multi-task training, launched from Python through torch.distributed.elastic.

Run the same command on every node (1 to 4 nodes may join):

    python 06_elastic_multitask.py --nproc-per-node 8 --min-nodes 1 --max-nodes 4 \
        --rdzv-endpoint head-node:29400 --run-id mt-0412 \
        --data /shared/datasets/mt --out /shared/runs/mt-0412

The agent restarts all workers (possibly with a different number of nodes)
when one fails, so the worker keeps its progress in global samples and
rebuilds its per-rank batch size from the current world size.
"""
import argparse
import logging
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

TASKS = ("species", "habitat")


class MultiTaskNet(nn.Module):
    """Shared ConvNeXt trunk, one linear head per task.

    A batch always comes from a single task, so the other head gets no
    gradient in that step.
    """

    def __init__(self, n_species, n_habitat):
        super().__init__()
        self.trunk = timm.create_model("convnext_tiny.fb_in22k", pretrained=True, num_classes=0)
        d = self.trunk.num_features
        self.heads = nn.ModuleDict({"species": nn.Linear(d, n_species), "habitat": nn.Linear(d, n_habitat)})

    def forward(self, x, task):
        return self.heads[task](self.trunk(x))


def make_loaders(args, world, rank, per_rank_batch):
    tf = transforms.Compose([transforms.RandomResizedCrop(224, scale=(0.35, 1)), transforms.RandomHorizontalFlip(),
                             transforms.ToTensor(), transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    vtf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(),
                              transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    loaders, samplers, vals, ncls = {}, {}, {}, {}
    for t in TASKS:
        tr = datasets.ImageFolder(os.path.join(args.data, t, "train"), tf)
        va = datasets.ImageFolder(os.path.join(args.data, t, "val"), vtf)
        ncls[t] = len(tr.classes)
        samplers[t] = DistributedSampler(tr, num_replicas=world, rank=rank, shuffle=True, seed=7, drop_last=True)
        loaders[t] = DataLoader(tr, batch_size=per_rank_batch, sampler=samplers[t], num_workers=6,
                                pin_memory=True, drop_last=True)
        shard = torch.utils.data.Subset(va, range(rank, len(va), world))
        vals[t] = DataLoader(shard, batch_size=per_rank_batch, num_workers=4, pin_memory=True)
    return loaders, samplers, vals, ncls


@torch.no_grad()
def evaluate(model, vals, device):
    model.eval()
    res = {}
    for t, dl in vals.items():
        c = torch.zeros(2, device=device)
        for x, y in dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                c[0] += (model.module(x, t).argmax(1) == y).sum()
            c[1] += y.numel()
        dist.all_reduce(c)
        res[t] = (c[0] / c[1]).item()
    model.train()
    return res


@record
def train(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [r{rank}/{world} try{restart}] %(message)s")
    log = logging.getLogger("mt")

    if args.global_batch % world:
        raise ValueError(f"global batch {args.global_batch} not divisible by world size {world}")
    per_rank = args.global_batch // world
    loaders, samplers, vals, ncls = make_loaders(args, world, rank, per_rank)

    model = MultiTaskNet(ncls["species"], ncls["habitat"]).to(device)
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    total_steps = args.total_samples // args.global_batch
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total_steps, pct_start=0.03)

    ckpt_path = os.path.join(args.out, "state.pt")
    step = 0
    if os.path.exists(ckpt_path):
        state = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        step = state["samples_seen"] // args.global_batch
        log.info("resumed at step %d (%d samples) with world size %d (saved with %d)",
                 step, state["samples_seen"], world, state["world"])

    epochs = {t: step // len(loaders[t]) for t in TASKS}
    iters = {}
    for t in TASKS:
        samplers[t].set_epoch(epochs[t])
        iters[t] = iter(loaders[t])

    model.train()
    t0 = time.time()
    while step < total_steps:
        task = TASKS[step % len(TASKS)]
        try:
            x, y = next(iters[task])
        except StopIteration:
            epochs[task] += 1
            samplers[task].set_epoch(epochs[task])
            iters[task] = iter(loaders[task])
            x, y = next(iters[task])
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x, task), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        step += 1

        if step % 100 == 0:
            l = loss.detach().clone()
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            log.info("step %d/%d %s loss %.4f (%.2fs/it)", step, total_steps, task, l.item(),
                     (time.time() - t0) / 100)
            t0 = time.time()
        if step % args.eval_every == 0 or step == total_steps:
            acc = evaluate(model, vals, device)
            log.info("step %d val %s", step, {k: round(v, 4) for k, v in acc.items()})
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                            "sched": sched.state_dict(), "samples_seen": step * args.global_batch,
                            "world": world}, ckpt_path + ".tmp")
                os.replace(ckpt_path + ".tmp", ckpt_path)
            dist.barrier()

    dist.destroy_process_group()
    return step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc-per-node", type=int, default=8)
    ap.add_argument("--min-nodes", type=int, default=1)
    ap.add_argument("--max-nodes", type=int, default=1)
    ap.add_argument("--rdzv-endpoint", default="localhost:29400")
    ap.add_argument("--run-id", default="mt")
    ap.add_argument("--max-restarts", type=int, default=10)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--global-batch", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--total-samples", type=int, default=40_000_000)
    ap.add_argument("--eval-every", type=int, default=2000)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    config = LaunchConfig(
        min_nodes=args.min_nodes,
        max_nodes=args.max_nodes,
        nproc_per_node=args.nproc_per_node,
        run_id=args.run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_configs={"timeout": 900},
        max_restarts=args.max_restarts,
        monitor_interval=5,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=os.path.join(args.out, "agent_logs"), redirects=Std.ALL, tee=Std.ERR),
    )
    results = elastic_launch(config, train)(args)
    print("finished, steps per rank:", results)


if __name__ == "__main__":
    main()
