"""Curriculum learning on CIFAR-100 with transfer-scored difficulty (Hacohen & Weinshall 2019).

Examples are ordered by a precomputed difficulty score (loss of a pretrained
scoring network, scores.npy aligned with the CIFAR-100 train set). A pacing
function grows the fraction of the easiest examples that is used in each epoch.
45k/5k train/val split of the official train set for early stopping.

    torchrun --nproc_per_node=4 13_curriculum_cifar.py --scores scores/cifar100_r50.npy \
        --pacing exp --start-frac 0.2 --inc 1.9 --step-epochs 10
"""
import argparse
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, random_split
from torch.utils.data.distributed import DistributedSampler
import wandb


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def pacing(epoch, n_total, args):
    if args.pacing == "none":
        return n_total
    if args.pacing == "exp":
        frac = args.start_frac * (args.inc ** (epoch // args.step_epochs))
    elif args.pacing == "linear":
        frac = args.start_frac + (1 - args.start_frac) * epoch / args.full_at
    else:
        raise ValueError(args.pacing)
    return int(min(1.0, frac) * n_total)


def make_model(num_classes):
    net = torchvision.models.resnet18(num_classes=num_classes)
    net.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    net.maxpool = nn.Identity()
    return net


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    crit = nn.CrossEntropyLoss(reduction="sum")
    t = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        out = net(x)
        t[0] += crit(out, y)
        t[1] += (out.argmax(1) == y).sum()
        t[2] += y.numel()
    dist.all_reduce(t)
    return (t[0] / t[2]).item(), (100 * t[1] / t[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/cifar100")
    ap.add_argument("--scores", required=True)
    ap.add_argument("--pacing", choices=["none", "exp", "linear"], default="exp")
    ap.add_argument("--start-frac", type=float, default=0.2)
    ap.add_argument("--inc", type=float, default=1.9)
    ap.add_argument("--step-epochs", type=int, default=10)
    ap.add_argument("--full-at", type=int, default=60)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--patience", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=64, help="per GPU")
    ap.add_argument("--lr", type=float, default=0.1, help="for total batch 256")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="ckpt/curriculum")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    set_seed(args.seed + rank)

    norm = T.Normalize((0.507, 0.487, 0.441), (0.267, 0.256, 0.276))
    train_tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), norm])
    full_train = torchvision.datasets.CIFAR100(args.data, train=True, transform=train_tf)
    full_eval = torchvision.datasets.CIFAR100(args.data, train=True, transform=T.Compose([T.ToTensor(), norm]))
    test_set = torchvision.datasets.CIFAR100(args.data, train=False, transform=T.Compose([T.ToTensor(), norm]))

    train_part, val_part = random_split(range(len(full_train)), [45000, 5000])
    train_idx, val_idx = list(train_part), list(val_part)

    scores = np.load(args.scores)
    assert len(scores) == len(full_train)
    order = sorted(train_idx, key=lambda i: scores[i])  # easiest first

    val_set = Subset(full_eval, val_idx[rank::world])
    val_loader = DataLoader(val_set, batch_size=500, num_workers=4)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)), batch_size=500,
                             num_workers=4)

    model = DDP(make_model(100).to(device), device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    criterion = nn.CrossEntropyLoss()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project="curriculum", config=vars(args))

    best_val, bad_epochs = math.inf, 0
    for epoch in range(args.epochs):
        n_use = pacing(epoch, len(order), args)
        subset = Subset(full_train, order[:n_use])
        sampler = DistributedSampler(subset, shuffle=True, seed=args.seed, drop_last=True)
        sampler.set_epoch(epoch)
        loader = DataLoader(subset, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                            pin_memory=True, drop_last=True)

        model.train()
        run = torch.zeros(2, device=device)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(run)

        val_loss, val_acc = evaluate(model.module, val_loader, device)
        if rank == 0:
            wandb.log({"epoch": epoch, "train/loss": (run[0] / run[1]).item(), "train/n_used": n_use,
                       "val/loss": val_loss, "val/acc": val_acc, "lr": scheduler.get_last_lr()[0]})

        # val_loss is all-reduced, so every rank takes the same decision
        if val_loss < best_val:
            best_val, bad_epochs = val_loss, 0
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "val_loss": val_loss},
                           os.path.join(args.out, "best.pth"))
        else:
            bad_epochs += 1
            if bad_epochs >= args.patience:
                if rank == 0:
                    print(f"early stop at epoch {epoch}")
                break

    dist.barrier()
    ckpt = torch.load(os.path.join(args.out, "best.pth"), map_location=device)
    model.module.load_state_dict(ckpt["model"])
    test_loss, test_acc = evaluate(model.module, test_loader, device)
    if rank == 0:
        print(f"best epoch {ckpt['epoch']}: test acc {test_acc:.2f}")
        wandb.summary["test_acc"] = test_acc
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
