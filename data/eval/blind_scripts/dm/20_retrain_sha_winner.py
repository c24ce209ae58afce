"""Final retrain of the successive-halving winner on CIFAR-100 and test report.

Reads ``<sha_dir>/winner.pt`` (config + learning curve of the surviving trial),
retrains that configuration from scratch with DDP on all 50k training images,
and reports test accuracy for the leaderboard.

    torchrun --nproc_per_node=8 retrain_winner.py --sha-dir runs/sha_wrn --epochs 200
"""
import argparse
import json
import math
import os
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

MEAN, STD = (0.507, 0.487, 0.441), (0.267, 0.256, 0.276)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--sha-dir", default="runs/sha_wrn")
    p.add_argument("--data", default="./data")
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--search-batch", type=int, default=128,
                   help="per-GPU batch used during the search")
    p.add_argument("--per-gpu-batch", type=int, default=128)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def build(cfg):
    model = timm.create_model(cfg["model"], num_classes=100, pretrained=False)
    model.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    model.maxpool = nn.Identity()
    return model


def data(args, rank, world):
    tf_train = transforms.Compose([transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(),
                                   transforms.TrivialAugmentWide(), transforms.ToTensor(),
                                   transforms.Normalize(MEAN, STD)])
    tf_test = transforms.Compose([transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    if rank == 0:
        datasets.CIFAR100(args.data, train=True, download=True)
        datasets.CIFAR100(args.data, train=False, download=True)
    dist.barrier()
    train = datasets.CIFAR100(args.data, train=True, transform=tf_train)
    test = datasets.CIFAR100(args.data, train=False, transform=tf_test)
    train_sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    test_sampler = DistributedSampler(test, num_replicas=world, rank=rank, shuffle=False)
    return (DataLoader(train, args.per_gpu_batch, sampler=train_sampler, num_workers=6, pin_memory=True,
                       drop_last=True, persistent_workers=True),
            DataLoader(test, 500, sampler=test_sampler, num_workers=4, pin_memory=True),
            train_sampler)


def mixup(x, y, alpha):
    if alpha <= 0:
        return x, y, y, 1.0
    lam = float(np.random.beta(alpha, alpha))
    idx = torch.randperm(x.size(0), device=x.device)
    return lam * x + (1 - lam) * x[idx], y, y[idx], lam


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        loss_sum += F.cross_entropy(logits.float(), y, reduction="sum").item()
        correct += (logits.argmax(1) == y).sum().item()
        total += y.numel()
    return correct / total, loss_sum / total


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    np.random.seed(args.seed + rank)

    winner = torch.load(os.path.join(args.sha_dir, "winner.pt"), map_location="cpu")
    cfg = winner["config"]
    train_loader, test_loader, train_sampler = data(args, rank, world)

    torch.manual_seed(args.seed)
    model = build(cfg).to(device, memory_format=torch.channels_last)
    model = DDP(model, device_ids=[local_rank])

    # the search ran a single GPU per trial: scale lr with the global batch
    scale = args.per_gpu_batch * world / args.search_batch
    peak_lr = cfg["lr"] * scale
    opt = torch.optim.SGD(model.parameters(), lr=peak_lr, momentum=0.9, nesterov=True,
                          weight_decay=cfg["weight_decay"])
    steps = args.epochs * len(train_loader)
    warm = args.warmup_epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (steps - warm))))

    out = os.path.join(args.sha_dir, "final")
    if rank == 0:
        os.makedirs(out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in train_loader:
            x = x.to(device, non_blocking=True, memory_format=torch.channels_last)
            y = y.to(device, non_blocking=True)
            x, ya, yb, lam = mixup(x, y, cfg["mixup_alpha"])
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out_logits = model(x)
                loss = lam * F.cross_entropy(out_logits, ya, label_smoothing=cfg["label_smoothing"]) + \
                    (1 - lam) * F.cross_entropy(out_logits, yb, label_smoothing=cfg["label_smoothing"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()

        if epoch % 10 == 9 or epoch == args.epochs - 1:
            acc, vloss = evaluate(model, test_loader, device)
            if rank == 0:
                print(f"epoch {epoch} test acc {acc:.4f} loss {vloss:.4f} "
                      f"lr {sched.get_last_lr()[0]:.4f} ({time.time() - t0:.0f}s/epoch)", flush=True)
                if acc > best:
                    best = acc
                    torch.save({"model": model.module.state_dict(), "config": cfg, "acc": acc},
                               os.path.join(out, "best.pt"))

    acc, vloss = evaluate(model, test_loader, device)
    if rank == 0:
        torch.save({"model": model.module.state_dict(), "config": cfg}, os.path.join(out, "last.pt"))
        with open(os.path.join(out, "test_result.json"), "w") as f:
            json.dump({"config": cfg, "search_curve": winner["curve"], "test_acc": acc,
                       "test_loss": vloss, "best_test_acc": best, "world_size": world,
                       "peak_lr": peak_lr}, f, indent=2)
        print(f"final test accuracy {acc:.4f} (best {best:.4f})", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
