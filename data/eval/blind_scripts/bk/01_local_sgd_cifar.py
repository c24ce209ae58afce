#!/usr/bin/env python
"""Local SGD (periodic model averaging) for ResNet-18 on CIFAR-10.

Every worker runs momentum SGD on its own shard of the training set and the
replicas are averaged with an all_reduce every --sync-every optimizer steps.
No DDP: communication happens only at the averaging points.

    torchrun --nproc_per_node=4 01_local_sgd_cifar.py --sync-every 8
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


def get_args():
    p = argparse.ArgumentParser(description="local SGD on CIFAR-10")
    p.add_argument("--data-dir", default="./data")
    p.add_argument("--out-dir", default="./runs/local_sgd")
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=128, help="per worker")
    p.add_argument("--lr", type=float, default=0.1, help="lr for a global batch of 512")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--wd", type=float, default=5e-4)
    p.add_argument("--warmup-epochs", type=int, default=2)
    p.add_argument("--sync-every", type=int, default=8)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", default="")
    p.add_argument("--log-every", type=int, default=50)
    return p.parse_args()


def build_model(num_classes=10):
    m = torchvision.models.resnet18(num_classes=num_classes)
    # CIFAR stem: 3x3 conv and no max-pool
    m.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    m.maxpool = nn.Identity()
    return m


@torch.no_grad()
def broadcast_model(model, src=0):
    for t in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(t.data, src=src)


@torch.no_grad()
def average_model(model, world_size):
    for p in model.parameters():
        dist.all_reduce(p.data, op=dist.ReduceOp.SUM)
        p.data.div_(world_size)
    # running stats are averaged too, num_batches_tracked is left alone
    for b in model.buffers():
        if b.dtype.is_floating_point:
            dist.all_reduce(b, op=dist.ReduceOp.SUM)
            b.div_(world_size)


def lr_at(step, total_steps, warmup_steps, base_lr):
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    t = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * base_lr * (1.0 + math.cos(math.pi * t))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # loss sum, correct, count
    for x, y in loader:
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        logits = model(x)
        stats[0] += F.cross_entropy(logits, y, reduction="sum")
        stats[1] += (logits.argmax(dim=1) == y).sum()
        stats[2] += y.numel()
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.benchmark = True

    train_tf = T.Compose([
        T.RandomCrop(32, padding=4),
        T.RandomHorizontalFlip(),
        T.ToTensor(),
        T.Normalize(CIFAR_MEAN, CIFAR_STD),
    ])
    test_tf = T.Compose([T.ToTensor(), T.Normalize(CIFAR_MEAN, CIFAR_STD)])

    # only one process downloads
    if rank == 0:
        torchvision.datasets.CIFAR10(args.data_dir, train=True, download=True)
        torchvision.datasets.CIFAR10(args.data_dir, train=False, download=True)
    dist.barrier()
    train_set = torchvision.datasets.CIFAR10(args.data_dir, train=True, transform=train_tf)
    test_set = torchvision.datasets.CIFAR10(args.data_dir, train=False, transform=test_tf)

    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank,
                                       shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    # strided shard without padding so the test accuracy is exact
    test_shard = Subset(test_set, list(range(rank, len(test_set), world_size)))
    test_loader = DataLoader(test_shard, batch_size=256, shuffle=False,
                             num_workers=args.workers, pin_memory=True)

    model = build_model().to(device)
    base_lr = args.lr * args.batch_size * world_size / 512
    optimizer = torch.optim.SGD(model.parameters(), lr=base_lr, momentum=args.momentum,
                                weight_decay=args.wd, nesterov=True)

    start_epoch, best_acc = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch = ckpt["epoch"] + 1
        best_acc = ckpt.get("best_acc", 0.0)
    broadcast_model(model)

    steps_per_epoch = len(train_loader)
    total_steps = args.epochs * steps_per_epoch
    warmup_steps = args.warmup_epochs * steps_per_epoch
    global_step = start_epoch * steps_per_epoch
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        print(f"world={world_size} steps/epoch={steps_per_epoch} base_lr={base_lr:.4f}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        model.train()
        t0 = time.time()
        running, seen = 0.0, 0
        for step, (x, y) in enumerate(train_loader):
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            for g in optimizer.param_groups:
                g["lr"] = lr_at(global_step, total_steps, warmup_steps, base_lr)

            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            global_step += 1

            if global_step % args.sync_every == 0:
                average_model(model, world_size)

            running += loss.item() * y.size(0)
            seen += y.size(0)
            if rank == 0 and step % args.log_every == 0:
                print(f"ep {epoch} step {step}/{steps_per_epoch} loss {loss.item():.4f} "
                      f"lr {optimizer.param_groups[0]['lr']:.4f}", flush=True)

        # make the replicas identical before evaluating / saving
        if global_step % args.sync_every != 0:
            average_model(model, world_size)

        val_loss, val_acc = evaluate(model, test_loader, device)
        if rank == 0:
            print(f"epoch {epoch} train_loss {running / max(seen, 1):.4f} val_loss {val_loss:.4f} "
                  f"val_acc {val_acc:.4f} time {time.time() - t0:.1f}s", flush=True)
            state = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "epoch": epoch,
                "best_acc": max(best_acc, val_acc),
                "args": vars(args),
            }
            torch.save(state, os.path.join(args.out_dir, "last.pt"))
            if val_acc > best_acc:
                torch.save(state, os.path.join(args.out_dir, "best.pt"))
        best_acc = max(best_acc, val_acc)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
