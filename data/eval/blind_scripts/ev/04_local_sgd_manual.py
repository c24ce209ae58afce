"""Local SGD on CIFAR-100: every worker runs its own SGD, parameters are averaged
every --sync-period steps with one all_reduce per tensor (no DDP).

H=1 reproduces synchronous mini-batch SGD; we sweep H in {1, 4, 16, 64}.

    torchrun --standalone --nproc_per_node=8 local_sgd_manual.py --sync-period 16
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.utils.data import DataLoader, Subset
from torchvision import datasets, transforms


def gn_resnet18(num_classes=100):
    # GroupNorm instead of BatchNorm: no running statistics to keep in sync between averaging rounds
    model = torchvision.models.resnet18(num_classes=num_classes, norm_layer=lambda c: nn.GroupNorm(32, c))
    model.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    model.maxpool = nn.Identity()
    return model


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/cifar100")
    ap.add_argument("--out", default="results/local_sgd")
    ap.add_argument("--epochs", type=int, default=150)
    ap.add_argument("--batch-size", type=int, default=128, help="per worker")
    ap.add_argument("--lr", type=float, default=0.1, help="per-worker LR")
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--wd", type=float, default=5e-4)
    ap.add_argument("--sync-period", type=int, default=16, help="H: local steps between averaging rounds")
    ap.add_argument("--warmup-epochs", type=int, default=5)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--workers", type=int, default=4)
    return ap.parse_args()


@torch.no_grad()
def average_model(model, world_size):
    for p in model.parameters():
        dist.all_reduce(p.data, op=dist.ReduceOp.SUM)
        p.data.div_(world_size)


@torch.no_grad()
def model_divergence(model, world_size):
    """Mean squared distance of this worker's parameters to the average (diagnostic only)."""
    sq = torch.zeros((), device=next(model.parameters()).device)
    for p in model.parameters():
        avg = p.data.clone()
        dist.all_reduce(avg)
        avg.div_(world_size)
        sq += (p.data - avg).pow(2).sum()
    dist.all_reduce(sq)
    return (sq / world_size).item()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        out = model(x)
        acc[0] += F.cross_entropy(out, y, reduction="sum")
        acc[1] += (out.argmax(dim=1) == y).sum()
        acc[2] += y.numel()
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def lr_at(epoch_float, args):
    if epoch_float < args.warmup_epochs:
        return args.lr * epoch_float / args.warmup_epochs
    # step decay at 50% and 75%
    if epoch_float < 0.5 * args.epochs:
        return args.lr
    if epoch_float < 0.75 * args.epochs:
        return args.lr * 0.1
    return args.lr * 0.01


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    torch.manual_seed(args.seed)
    torch.cuda.manual_seed(args.seed)

    mean, std = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
    train_tf = transforms.Compose([transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), transforms.Normalize(mean, std)])
    test_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])
    train_set = datasets.CIFAR100(args.data, train=True, download=False, transform=train_tf)
    test_set = datasets.CIFAR100(args.data, train=False, download=False, transform=test_tf)

    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)), batch_size=500,
                             num_workers=args.workers, pin_memory=True)

    model = gn_resnet18().to(device)
    # identical starting point on every worker
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p.data, src=0)

    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.wd, nesterov=True)

    history = []
    steps_per_epoch = len(train_loader)
    local_step = 0
    comm_time = 0.0
    for epoch in range(args.epochs):
        t0 = time.time()
        loss_acc = torch.zeros(2, device=device)
        for i, (x, y) in enumerate(train_loader):
            for g in optimizer.param_groups:
                g["lr"] = lr_at(epoch + i / steps_per_epoch, args)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            local_step += 1
            loss_acc[0] += loss.detach()
            loss_acc[1] += 1

            if local_step % args.sync_period == 0:
                torch.cuda.synchronize()
                tc = time.time()
                average_model(model, world)
                torch.cuda.synchronize()
                comm_time += time.time() - tc

        div = model_divergence(model, world)
        average_model(model, world)
        dist.all_reduce(loss_acc)
        test_loss, test_acc = evaluate(model, test_loader, device)
        rec = {
            "epoch": epoch,
            "train_loss": (loss_acc[0] / loss_acc[1]).item(),
            "test_loss": test_loss,
            "test_acc": test_acc,
            "divergence": div,
            "epoch_time": time.time() - t0,
            "comm_time": comm_time,
            "samples_seen": (epoch + 1) * steps_per_epoch * args.batch_size * world,
        }
        history.append(rec)
        if rank == 0:
            print(json.dumps(rec), flush=True)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        tag = f"H{args.sync_period}_w{world}_s{args.seed}"
        torch.save(model.state_dict(), os.path.join(args.out, f"model_{tag}.pt"))
        with open(os.path.join(args.out, f"history_{tag}.json"), "w") as f:
            json.dump(history, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
