"""Optuna hyperparameter sweep for a small ViT on Tiny-ImageNet, one DDP job.

Rank 0 owns the Optuna study (SQLite storage); the sampled parameters and the
prune decision are broadcast so that every rank runs the same trial.
"""
import argparse
import math
import os

import optuna
import torch
import torch.distributed as dist
import torch.nn as nn
import timm
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/mnt/datasets/tiny-imagenet-200")
    ap.add_argument("--storage", default="sqlite:///vit_sweep.db")
    ap.add_argument("--study", default="vit-tiny-sweep")
    ap.add_argument("--n-trials", type=int, default=60)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--global-batch", type=int, default=512)
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


def loaders(args, world):
    mean, std = (0.480, 0.448, 0.398), (0.277, 0.269, 0.282)
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(64, scale=(0.35, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.TrivialAugmentWide(),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    val_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])
    train_set = datasets.ImageFolder(os.path.join(args.root, "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(args.root, "val_sorted"), val_tf)
    per_rank = args.global_batch // world
    tr_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    va_sampler = DistributedSampler(val_set, shuffle=False)
    tr = DataLoader(train_set, per_rank, sampler=tr_sampler, num_workers=args.workers,
                    pin_memory=True, drop_last=True, persistent_workers=True)
    va = DataLoader(val_set, 256, sampler=va_sampler, num_workers=args.workers, pin_memory=True)
    return tr, va, tr_sampler


def build_model(hp):
    return timm.create_model(
        "vit_tiny_patch16_224", img_size=64, patch_size=hp["patch"], num_classes=200,
        drop_path_rate=hp["drop_path"], pretrained=False,
    )


def cosine_warmup(step, total, warmup):
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    correct, seen = 0, 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(x).argmax(-1)
        correct += (pred == y).sum().item()
        seen += y.numel()
    return correct / seen


def train_trial(hp, args, data, device, local_rank, trial=None):
    tr, va, sampler = data
    model = build_model(hp).to(device)
    model = DDP(model, device_ids=[local_rank])
    decay = [p for n, p in model.named_parameters() if p.ndim > 1 and "pos_embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1 or "pos_embed" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": hp["wd"]},
                             {"params": no_decay, "weight_decay": 0.0}], lr=hp["lr"], betas=(0.9, 0.999))
    total = args.epochs * len(tr)
    warmup = int(hp["warmup_frac"] * total)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: cosine_warmup(s, total, warmup))
    crit = nn.CrossEntropyLoss(label_smoothing=hp["smoothing"])

    acc = 0.0
    for epoch in range(args.epochs):
        model.train()
        sampler.set_epoch(epoch)
        for x, y in tr:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = crit(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()

        acc = validate(model, va, device)
        prune = torch.zeros(1, device=device)
        if dist.get_rank() == 0:
            trial.report(acc, epoch)
            prune[0] = float(trial.should_prune())
        dist.broadcast(prune, src=0)
        if prune.item():
            break

    del model, opt
    torch.cuda.empty_cache()
    return acc, bool(prune.item())


def suggest(trial):
    return {
        "lr": trial.suggest_float("lr", 1e-4, 3e-3, log=True),
        "wd": trial.suggest_float("wd", 0.01, 0.3, log=True),
        "warmup_frac": trial.suggest_float("warmup_frac", 0.0, 0.15),
        "drop_path": trial.suggest_float("drop_path", 0.0, 0.3),
        "smoothing": trial.suggest_categorical("smoothing", [0.0, 0.1]),
        "patch": trial.suggest_categorical("patch", [4, 8]),
    }


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    data = loaders(args, world)
    study = None
    if rank == 0:
        study = optuna.create_study(
            study_name=args.study, storage=args.storage, direction="maximize", load_if_exists=True,
            pruner=optuna.pruners.MedianPruner(n_startup_trials=5, n_warmup_steps=5),
        )

    for _ in range(args.n_trials):
        box = [None, None]
        if rank == 0:
            trial = study.ask()
            box = [trial.number, suggest(trial)]
        else:
            trial = None
        dist.broadcast_object_list(box, src=0)
        number, hp = box

        acc, pruned = train_trial(hp, args, data, device, local_rank, trial)

        if rank == 0:
            state = optuna.trial.TrialState.PRUNED if pruned else optuna.trial.TrialState.COMPLETE
            study.tell(trial, None if pruned else acc, state=state)
            print(f"trial {number} {'pruned' if pruned else 'done'} acc={acc:.4f} hp={hp}", flush=True)

    if rank == 0:
        print("best trial", study.best_trial.number, study.best_value, study.best_params)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
