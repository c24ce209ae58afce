"""Optuna search over MLP-Mixer hyperparameters on CIFAR-10, one process per GPU via mp.spawn.

    python 17_optuna_spawn_mixer.py --gpus 4 --trials 50 --storage sqlite:///mixer.db
"""
import argparse
import os
from contextlib import nullcontext

import optuna
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler


class MixerBlock(nn.Module):
    def __init__(self, n_tokens, dim, token_mlp, channel_mlp, drop):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.token = nn.Sequential(nn.Linear(n_tokens, token_mlp), nn.GELU(), nn.Dropout(drop), nn.Linear(token_mlp, n_tokens))
        self.norm2 = nn.LayerNorm(dim)
        self.channel = nn.Sequential(nn.Linear(dim, channel_mlp), nn.GELU(), nn.Dropout(drop), nn.Linear(channel_mlp, dim))

    def forward(self, x):
        x = x + self.token(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel(self.norm2(x))


class Mixer(nn.Module):
    def __init__(self, patch, dim, depth, drop, num_classes=10, img=32):
        super().__init__()
        n = (img // patch) ** 2
        self.patchify = nn.Conv2d(3, dim, patch, patch)
        self.blocks = nn.Sequential(*[MixerBlock(n, dim, dim // 2, dim * 4, drop) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        x = self.patchify(x).flatten(2).transpose(1, 2)
        return self.head(self.norm(self.blocks(x)).mean(1))

    def num_params(self):
        return sum(p.numel() for p in self.parameters())


def suggest(trial):
    return {
        "patch": trial.suggest_categorical("patch", [2, 4]),
        "dim": trial.suggest_categorical("dim", [128, 256, 384]),
        "depth": trial.suggest_int("depth", 4, 10, step=2),
        "drop": trial.suggest_float("drop", 0.0, 0.3),
        "lr": trial.suggest_float("lr", 3e-4, 5e-3, log=True),
        "wd": trial.suggest_float("wd", 1e-3, 0.1, log=True),
    }


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    t = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        t[0] += (model(x).argmax(1) == y).sum()
        t[1] += y.numel()
    dist.all_reduce(t)
    return (t[0] / t[1]).item()


def worker(rank, world_size, args):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)

    norm = T.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    train_full = torchvision.datasets.CIFAR10(args.data, train=True, transform=T.Compose([
        T.RandomCrop(32, 4), T.RandomHorizontalFlip(), T.ToTensor(), norm]))
    eval_full = torchvision.datasets.CIFAR10(args.data, train=True, transform=T.Compose([T.ToTensor(), norm]))
    train_set = Subset(train_full, range(0, 45000))
    val_set = Subset(eval_full, range(45000 + rank, 50000, world_size))
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    micro_bs = args.batch_size // (world_size * args.accum)
    train_loader = DataLoader(train_set, micro_bs, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_set, 500, num_workers=2)

    study = None
    if rank == 0:
        study = optuna.create_study(study_name=args.study, storage=args.storage, load_if_exists=True,
                                    direction="maximize",
                                    pruner=optuna.pruners.HyperbandPruner(min_resource=3, max_resource=args.epochs))

    for _ in range(args.trials):
        payload = [None]
        trial = None
        if rank == 0:
            trial = study.ask()
            payload = [suggest(trial)]
        dist.broadcast_object_list(payload, src=0)
        hp = payload[0]

        torch.manual_seed(args.seed)
        model = DDP(Mixer(hp["patch"], hp["dim"], hp["depth"], hp["drop"]).to(device), device_ids=[rank])
        opt = torch.optim.AdamW(model.parameters(), lr=hp["lr"], weight_decay=hp["wd"])
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, hp["lr"], epochs=args.epochs,
                                                    steps_per_epoch=len(train_loader) // args.accum)
        if rank == 0:
            print(f"trial {trial.number}: {hp} ({model.module.num_params() / 1e6:.2f}M params)", flush=True)

        pruned, acc = False, 0.0
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            opt.zero_grad(set_to_none=True)
            for i, (x, y) in enumerate(train_loader):
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                last_micro = (i + 1) % args.accum == 0
                with (nullcontext() if last_micro else model.no_sync()):
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss = F.cross_entropy(model(x), y, label_smoothing=0.1) / args.accum
                    loss.backward()
                if last_micro:
                    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    sched.step()
            acc = evaluate(model, val_loader, device)
            flag = [False]
            if rank == 0:
                trial.report(acc, epoch)
                flag = [trial.should_prune()]
            dist.broadcast_object_list(flag, src=0)
            if flag[0]:
                pruned = True
                break

        if rank == 0:
            if pruned:
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            else:
                study.tell(trial, acc)
        del model, opt, sched
        torch.cuda.empty_cache()

    if rank == 0:
        print("best:", study.best_params, study.best_value, flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--data", default="./data")
    ap.add_argument("--storage", default="sqlite:///mixer.db")
    ap.add_argument("--study", default="mixer-c10")
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=512, help="global batch")
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--port", type=int, default=29512)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    # download once in the parent, before any worker starts
    torchvision.datasets.CIFAR10(args.data, train=True, download=True)
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
