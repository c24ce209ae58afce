"""Synchronous data-parallel SGD written out by hand (baseline for the
compression experiments): gradients are averaged with one all_reduce per
parameter after backward, then clipped by global norm, then SGD steps.
BatchNorm running statistics are averaged once per epoch.

Single node, started with mp.spawn (no torchrun):
    python manual_avg_spawn.py --data /data/cifar10 --gpus 4
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/cifar10")
    ap.add_argument("--out", default="runs/manual_avg")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--port", type=int, default=29511)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=128, help="per GPU")
    ap.add_argument("--lr", type=float, default=0.4, help="for the global batch")
    ap.add_argument("--wd", type=float, default=5e-4)
    ap.add_argument("--clip", type=float, default=2.0)
    ap.add_argument("--resume", action="store_true")
    return ap.parse_args()


def make_model():
    m = torchvision.models.resnet18(num_classes=10)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


@torch.no_grad()
def broadcast_model(model):
    for t in model.state_dict().values():
        dist.broadcast(t, src=0)


@torch.no_grad()
def average_gradients(model, world):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad.div_(world)


@torch.no_grad()
def average_bn_stats(model, world):
    for name, buf in model.named_buffers():
        if name.endswith(("running_mean", "running_var")):
            dist.all_reduce(buf)
            buf.div_(world)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        s[0] += (model(x).argmax(1) == y).sum()
        s[1] += y.numel()
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item()


def worker(rank, world, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world)
    device = torch.device("cuda", rank)

    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    train_set = datasets.CIFAR10(args.data, train=True, download=False, transform=transforms.Compose([
        transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), transforms.Normalize(mean, std)]))
    test_set = datasets.CIFAR10(args.data, train=False, download=False, transform=transforms.Compose([
        transforms.ToTensor(), transforms.Normalize(mean, std)]))
    # drop_last on the sampler and the loader: every rank runs the same number of steps
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                              pin_memory=True, drop_last=True)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)), batch_size=500, num_workers=2)

    model = make_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.wd)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, epochs=args.epochs,
                                                    steps_per_epoch=len(train_loader))
    ckpt_path = os.path.join(args.out, "last.pt")
    start_epoch = 0
    if args.resume and os.path.exists(ckpt_path):
        # saved from cuda:0 by rank 0; remap onto this rank's device
        ckpt = torch.load(ckpt_path, map_location={"cuda:0": f"cuda:{rank}"})
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1
    broadcast_model(model)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        total_loss = torch.zeros((), device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            average_gradients(model, world)
            # computed on the averaged gradients, so the norm and the clip factor are the same on every rank
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            scheduler.step()
            total_loss += loss.detach()
        average_bn_stats(model, world)
        dist.all_reduce(total_loss, op=dist.ReduceOp.AVG)
        acc = evaluate(model, test_loader, device)
        if rank == 0:
            print(f"epoch {epoch} loss {total_loss.item() / len(train_loader):.4f} "
                  f"last gnorm {gnorm.item():.2f} acc {acc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch}, ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)
