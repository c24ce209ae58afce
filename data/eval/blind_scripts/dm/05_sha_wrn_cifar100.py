"""Successive halving for WideResNet hyper-parameters on CIFAR-100.

One trial per GPU.  Rungs at 1, 3, 9, 27 epochs (eta=3): at each rung the
trials are ranked by validation accuracy and the best 1/eta continue.  Stopped
trials stay alive as processes and keep taking part in the rung exchange, so
the leaderboard (with every trial's learning curve) can be written by rank 0.

    torchrun --nproc_per_node=8 sha_wrn.py --out runs/sha_wrn
"""
import argparse
import json
import os

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, random_split
from torchvision import datasets, transforms


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="./data")
    p.add_argument("--out", default="runs/sha_wrn")
    p.add_argument("--eta", type=int, default=3)
    p.add_argument("--rungs", type=int, nargs="+", default=[1, 3, 9, 27])
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--seed", type=int, default=3)
    return p.parse_args()


def trial_config(seed, trial_id):
    rng = np.random.default_rng([seed, trial_id])
    return {
        "model": str(rng.choice(["wide_resnet50_2", "resnet50", "resnext50_32x4d"])),
        "lr": float(10 ** rng.uniform(-2, -0.5)),
        "weight_decay": float(10 ** rng.uniform(-4.5, -3)),
        "label_smoothing": float(rng.uniform(0.0, 0.15)),
        "mixup_alpha": float(rng.choice([0.0, 0.2, 0.4])),
    }


def loaders(args, rank):
    norm = transforms.Normalize((0.507, 0.487, 0.441), (0.267, 0.256, 0.276))
    tf_train = transforms.Compose([transforms.RandomCrop(32, padding=4),
                                   transforms.RandomHorizontalFlip(),
                                   transforms.TrivialAugmentWide(),
                                   transforms.ToTensor(), norm])
    tf_val = transforms.Compose([transforms.ToTensor(), norm])
    if rank == 0:
        datasets.CIFAR100(args.data, train=True, download=True)
    dist.barrier()
    full_t = datasets.CIFAR100(args.data, train=True, transform=tf_train)
    full_v = datasets.CIFAR100(args.data, train=True, transform=tf_val)
    g = torch.Generator().manual_seed(args.seed)
    tr_idx, va_idx = random_split(range(len(full_t)), [45000, 5000], generator=g)
    train = torch.utils.data.Subset(full_t, list(tr_idx))
    val = torch.utils.data.Subset(full_v, list(va_idx))
    return (DataLoader(train, args.batch_size, shuffle=True, num_workers=args.workers,
                       pin_memory=True, drop_last=True, persistent_workers=True),
            DataLoader(val, 500, shuffle=False, num_workers=args.workers, pin_memory=True))


def mixup(x, y, alpha):
    if alpha <= 0:
        return x, y, y, 1.0
    lam = float(np.random.beta(alpha, alpha))
    idx = torch.randperm(x.size(0), device=x.device)
    return lam * x + (1 - lam) * x[idx], y, y[idx], lam


def train_epoch(model, loader, opt, sched, cfg, device):
    model.train()
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        x, ya, yb, lam = mixup(x, y, cfg["mixup_alpha"])
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
            loss = lam * F.cross_entropy(out, ya, label_smoothing=cfg["label_smoothing"]) + \
                (1 - lam) * F.cross_entropy(out, yb, label_smoothing=cfg["label_smoothing"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()


@torch.no_grad()
def val_acc(model, loader, device):
    model.eval()
    hit = n = 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            hit += (model(x).argmax(-1) == y).sum().item()
        n += y.numel()
    return hit / n


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed * 100 + rank)
    np.random.seed(args.seed * 100 + rank)

    cfg = trial_config(args.seed, rank)
    train_loader, val_loader = loaders(args, rank)
    model = timm.create_model(cfg["model"], num_classes=100, pretrained=False)
    # small-image stem
    model.conv1 = torch.nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    model.maxpool = torch.nn.Identity()
    model = model.to(device, memory_format=torch.channels_last)

    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9, nesterov=True,
                          weight_decay=cfg["weight_decay"])
    # schedule laid out for the largest budget so that early rungs see the same
    # learning rate as they would in a full run
    max_steps = max(args.rungs) * len(train_loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg["lr"], total_steps=max_steps,
                                                pct_start=0.1)

    alive = True
    history = []
    done = 0
    board = {}
    for rung in args.rungs:
        if alive:
            while done < rung:
                train_epoch(model, train_loader, opt, sched, cfg, device)
                done += 1
                history.append(val_acc(model, val_loader, device))
            print(f"[trial {rank}] rung {rung}: acc {history[-1]:.4f}", flush=True)

        score = torch.tensor([history[-1] if alive else -1.0], device=device)
        scores = [torch.zeros_like(score) for _ in range(world)]
        dist.all_gather(scores, score)
        scores = torch.cat(scores).tolist()

        curve = torch.tensor(history, device=device)
        curves = [torch.empty_like(curve) for _ in range(world)]
        dist.all_gather(curves, curve)

        n_alive = sum(s >= 0 for s in scores)
        n_keep = max(1, n_alive // args.eta)
        ranking = sorted((r for r in range(world) if scores[r] >= 0),
                         key=lambda r: (-scores[r], r))
        keep = set(ranking[:n_keep])
        alive = alive and rank in keep

        if rank == 0:
            board = {
                "rung": rung,
                "trials": [{"trial": r, "config": trial_config(args.seed, r),
                            "score": scores[r], "curve": curves[r].tolist(),
                            "continues": r in keep} for r in range(world)],
            }
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"rung_{rung:03d}.json"), "w") as f:
                json.dump(board, f, indent=2)

    winner = ranking[0]
    if rank == winner:
        torch.save({"model": model.state_dict(), "config": cfg, "curve": history},
                   os.path.join(args.out, "winner.pt"))
        print(f"winner: trial {rank} acc {history[-1]:.4f} {cfg}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
