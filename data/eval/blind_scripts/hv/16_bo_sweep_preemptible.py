"""Bayesian-optimisation sweep (scikit-optimize GP) over training hyperparameters of a
ConvNeXt-Tiny on ImageNet-100, written to survive preemption on the spot queue.

A single checkpoint file holds the sweep history plus the state of the trial in
progress; on restart the job re-tells the history to the optimiser and continues
the interrupted trial from its last epoch.

    torchrun --nnodes=1 --nproc_per_node=8 16_bo_sweep_preemptible.py --ckpt /checkpoints/bo_convnext.pt
"""
import argparse
import math
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from skopt import Optimizer
from skopt.space import Categorical, Real
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

SPACE = [
    Real(1e-4, 4e-3, prior="log-uniform", name="lr"),
    Real(0.01, 0.2, prior="log-uniform", name="weight_decay"),
    Real(0.0, 0.3, name="drop_path"),
    Categorical([0.0, 0.1], name="smoothing"),
]
NAMES = [d.name for d in SPACE]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/datasets/imagenet100")
    p.add_argument("--ckpt", default="/checkpoints/bo_convnext.pt")
    p.add_argument("--trials", type=int, default=32)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--warmup-epochs", type=int, default=2)
    p.add_argument("--global-bs", type=int, default=1024)
    p.add_argument("--workers", type=int, default=10)
    return p.parse_args()


def make_loaders(args, rank, world):
    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    tr = datasets.ImageFolder(os.path.join(args.data, "train"), transforms.Compose([
        transforms.RandomResizedCrop(176), transforms.RandomHorizontalFlip(),
        transforms.RandAugment(2, 9), transforms.ToTensor(), norm]))
    va = datasets.ImageFolder(os.path.join(args.data, "val"), transforms.Compose([
        transforms.Resize(232), transforms.CenterCrop(224), transforms.ToTensor(), norm]))
    sampler = DistributedSampler(tr, shuffle=True, drop_last=True)
    train_loader = DataLoader(tr, args.global_bs // world, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(Subset(va, range(rank, len(va), world)), 250, num_workers=args.workers, pin_memory=True)
    return train_loader, val_loader, sampler


def lr_lambda(warmup, total):
    def f(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
    return f


@torch.no_grad()
def top1(model, loader, device):
    model.eval()
    s = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            s[0] += (model(x).argmax(1) == y).sum()
        s[1] += y.numel()
    dist.all_reduce(s)
    return (s[0] / s[1]).item()


def save_state(path, state):
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    train_loader, val_loader, sampler = make_loaders(args, rank, world)
    steps_per_epoch = len(train_loader)

    history, resume = [], None
    if os.path.exists(args.ckpt):
        resume = torch.load(args.ckpt)
        history = resume["history"]
        if rank == 0:
            print(f"resuming: {len(history)} finished trials, current trial at epoch {resume.get('epoch')}", flush=True)

    bo = None
    if rank == 0:
        bo = Optimizer(SPACE, base_estimator="GP", acq_func="EI", n_initial_points=8, random_state=0)
        if history:
            bo.tell([h["x"] for h in history], [-h["acc"] for h in history])

    while len(history) < args.trials:
        if resume is not None and resume.get("x") is not None:
            x = resume["x"]
        else:
            box = [[float(v) for v in bo.ask()] if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            x = box[0]
        hp = dict(zip(NAMES, x))

        model = timm.create_model("convnext_tiny", num_classes=100, drop_path_rate=hp["drop_path"]).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=hp["lr"], weight_decay=hp["weight_decay"])
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lr_lambda(args.warmup_epochs * steps_per_epoch, args.epochs * steps_per_epoch))
        start_epoch = 0
        if resume is not None and resume.get("x") is not None:
            model.load_state_dict(resume["model"])
            opt.load_state_dict(resume["opt"])
            sched.load_state_dict(resume["sched"])
            start_epoch = resume["epoch"] + 1
        resume = None
        model = DDP(model, device_ids=[local_rank])
        crit = nn.CrossEntropyLoss(label_smoothing=hp["smoothing"])

        t0 = time.time()
        for epoch in range(start_epoch, args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            for imgs, labels in train_loader:
                imgs, labels = imgs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = crit(model(imgs), labels)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                opt.step()
                sched.step()
            if rank == 0:
                save_state(args.ckpt, {"history": history, "x": x, "epoch": epoch,
                                       "model": model.module.state_dict(), "opt": opt.state_dict(),
                                       "sched": sched.state_dict()})
            dist.barrier()

        acc = top1(model, val_loader, device)
        history.append({"x": x, "acc": acc, "minutes": (time.time() - t0) / 60})
        if rank == 0:
            bo.tell(x, -acc)
            save_state(args.ckpt, {"history": history, "x": None})
            print(f"trial {len(history)}/{args.trials} {hp} -> top1 {acc:.4f}", flush=True)
        dist.barrier()
        del model, opt, sched
        torch.cuda.empty_cache()

    if rank == 0:
        best = max(history, key=lambda h: h["acc"])
        print("best:", dict(zip(NAMES, best["x"])), best["acc"])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
