"""Multi-dataset remote sensing pretraining of a Swin-B on Sentinel-2 RGB patches.

    bigearthnet : 19-class multi-label, ~520k patches
    eurosat     : 10-class land use, 27k patches
    so2sat      : 17 local climate zones, ~350k patches
    fmow        : 62-class functional map of the world, ~360k crops

Temperature sampling (T=3) picks the dataset of each step; the draw is reproducible
and restored on resume, so a restarted job continues the same task sequence.
Jobs are preempted every few hours, so --resume auto picks up the newest checkpoint.

    torchrun --nproc_per_node=8 20_remote_sensing_multitask.py --data /lustre/rs \
        --out /lustre/rs_runs/swin_mt --resume auto
"""
import argparse
import glob
import os
import re
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

from rsdata import build_dataset  # returns (image tensor, target) for a dataset name and split

SPEC = {
    "bigearthnet": {"n": 19, "multilabel": True},
    "eurosat": {"n": 10, "multilabel": False},
    "so2sat": {"n": 17, "multilabel": False},
    "fmow": {"n": 62, "multilabel": False},
}


class RSMultiTask(nn.Module):
    def __init__(self, arch):
        super().__init__()
        self.backbone = timm.create_model(arch, pretrained=True, num_classes=0, drop_path_rate=0.3)
        d = self.backbone.num_features
        self.heads = nn.ModuleDict({k: nn.Linear(d, v["n"]) for k, v in SPEC.items()})

    def forward(self, x, task):
        return self.heads[task](self.backbone(x))


def criterion(task, logits, y):
    if SPEC[task]["multilabel"]:
        return F.binary_cross_entropy_with_logits(logits, y.float())
    return F.cross_entropy(logits, y, label_smoothing=0.1)


def latest_checkpoint(out):
    files = glob.glob(os.path.join(out, "ckpt_*.pt"))
    if not files:
        return None
    return max(files, key=lambda f: int(re.findall(r"ckpt_(\d+)\.pt", f)[0]))


@torch.no_grad()
def evaluate(net, val_sets, device, rank, world):
    net.eval()
    res = {}
    for task, ds in val_sets.items():
        st = torch.zeros(2, device=device, dtype=torch.float64)
        for x, y in DataLoader(Subset(ds, range(rank, len(ds), world)), batch_size=256, num_workers=8):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = net(x, task).float()
            if SPEC[task]["multilabel"]:
                pred = (logits > 0).float()
                tp = (pred * y).sum(1)
                f1 = 2 * tp / (pred.sum(1) + y.sum(1)).clamp(min=1)  # sample-wise F1
                st[0] += f1.sum().double()
            else:
                st[0] += (logits.argmax(1) == y).sum().double()
            st[1] += x.size(0)
        dist.all_reduce(st)
        res[task] = (st[0] / st[1]).item()
    net.train()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--arch", default="swin_base_patch4_window7_224.ms_in22k")
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--steps", type=int, default=150000)
    ap.add_argument("--warmup", type=int, default=5000)
    ap.add_argument("--temperature", type=float, default=3.0)
    ap.add_argument("--save_every", type=int, default=2500)
    ap.add_argument("--eval_every", type=int, default=10000)
    ap.add_argument("--resume", default="")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_sets = {t: build_dataset(args.data, t, "train") for t in SPEC}
    val_sets = {t: build_dataset(args.data, t, "val") for t in SPEC}
    tasks = list(SPEC)
    p = np.array([len(train_sets[t]) for t in tasks], dtype=np.float64) ** (1.0 / args.temperature)
    p /= p.sum()

    samplers = {t: DistributedSampler(train_sets[t], shuffle=True, seed=args.seed) for t in tasks}
    loaders = {t: DataLoader(train_sets[t], batch_size=args.bs, sampler=samplers[t], num_workers=6,
                             pin_memory=True, drop_last=True, persistent_workers=True) for t in tasks}

    net = RSMultiTask(args.arch).to(device)
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)
    decay, no_decay = [], []
    for n, prm in model.module.named_parameters():
        (no_decay if prm.ndim <= 1 or "relative_position_bias_table" in n else decay).append(prm)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.999))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / args.warmup if s < args.warmup
        else 0.5 * (1 + np.cos(np.pi * (s - args.warmup) / (args.steps - args.warmup))))

    task_rng = np.random.default_rng(args.seed)
    passes = {t: 0 for t in tasks}
    step = 0
    resume = latest_checkpoint(args.out) if args.resume == "auto" else args.resume
    if resume:
        ckpt = torch.load(resume)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        task_rng.bit_generator.state = ckpt["task_rng"]
        passes = ckpt["passes"]
        step = ckpt["step"]
        if rank == 0:
            print(f"resumed from {resume} at step {step}", flush=True)
        del ckpt

    its = {}
    for t in tasks:
        samplers[t].set_epoch(passes[t])
        its[t] = iter(loaders[t])

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    while step < args.steps:
        task = tasks[task_rng.choice(len(tasks), p=p)]
        try:
            x, y = next(its[task])
        except StopIteration:
            passes[task] += 1
            samplers[task].set_epoch(passes[task])
            its[task] = iter(loaders[task])
            x, y = next(its[task])
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x, task)
        loss = criterion(task, logits.float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        opt.step()
        sched.step()
        step += 1

        if rank == 0 and step % 100 == 0:
            print(f"step {step} {task:12s} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                  f"{(time.time() - t0) / 100:.3f}s/it", flush=True)
            t0 = time.time()
        if step % args.eval_every == 0:
            res = evaluate(model.module, val_sets, device, rank, world)
            if rank == 0:
                print(f"eval @{step}: {res}", flush=True)
        if step % args.save_every == 0 or step == args.steps:
            if rank == 0:
                tmp = os.path.join(args.out, f"ckpt_{step}.pt.tmp")
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                            "sched": sched.state_dict(), "task_rng": task_rng.bit_generator.state,
                            "passes": passes, "step": step}, tmp)
                os.replace(tmp, os.path.join(args.out, f"ckpt_{step}.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
