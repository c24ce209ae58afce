#!/usr/bin/env python3
"""
CIFAR-100 ResNet-18 across the desktop and the laptop.

The laptop (RTX 3060 mobile) is only on Wi-Fi, and NCCL's socket transport
kept stalling over it, so this runs on gloo. Gloo handles the CUDA gradient
buckets for DDP fine, it is just a bit slower.

    desktop (192.168.0.10, RTX 2080 Super):
        GLOO_SOCKET_IFNAME=enp5s0 torchrun --nnodes=2 --nproc_per_node=1 --node_rank=0 \
            --master_addr=192.168.0.10 --master_port=29400 cifar100_gloo.py --init-from r18_tinyimnet.pt
    laptop (192.168.0.23):
        GLOO_SOCKET_IFNAME=wlp2s0 torchrun --nnodes=2 --nproc_per_node=1 --node_rank=1 \
            --master_addr=192.168.0.10 --master_port=29400 cifar100_gloo.py

Only the desktop has the pretrained weights; DDP copies rank 0's parameters
and buffers to every rank when it wraps the model.
"""
import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

CIFAR_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR_STD = (0.2673, 0.2564, 0.2762)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", default=os.path.expanduser("~/datasets"))
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=128, help="per process")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--wd", type=float, default=5e-4)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--init-from", default="", help="backbone weights, only needed on rank 0")
    ap.add_argument("--save", default="cifar100_r18.pt")
    return ap.parse_args()


def make_model(num_classes=100):
    net = torchvision.models.resnet18(num_classes=num_classes)
    # CIFAR stem: 3x3 conv, no max-pool
    net.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    net.maxpool = nn.Identity()
    return net


def load_backbone(net, path):
    sd = torch.load(path, map_location="cpu")
    sd = sd.get("model", sd)
    sd = {k.replace("module.", "", 1): v for k, v in sd.items()}
    sd = {k: v for k, v in sd.items() if not k.startswith("fc.")}
    missing, unexpected = net.load_state_dict(sd, strict=False)
    return missing, unexpected


def loaders(args, rank, world):
    train_tf = transforms.Compose([
        transforms.RandomCrop(32, padding=4),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(CIFAR_MEAN, CIFAR_STD),
    ])
    test_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(CIFAR_MEAN, CIFAR_STD)])
    # each machine has its own copy; download=False so nobody fetches mid-run
    train = torchvision.datasets.CIFAR100(args.data_dir, train=True, transform=train_tf, download=False)
    test = torchvision.datasets.CIFAR100(args.data_dir, train=False, transform=test_tf, download=False)
    tr_sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=17)
    te_sampler = DistributedSampler(test, num_replicas=world, rank=rank, shuffle=False)
    tr = DataLoader(train, batch_size=args.batch_size, sampler=tr_sampler,
                    num_workers=args.workers, pin_memory=True, drop_last=True)
    te = DataLoader(test, batch_size=256, sampler=te_sampler, num_workers=args.workers,
                    pin_memory=True)
    return tr, te, tr_sampler


def evaluate(model, loader, device):
    model.eval()
    correct = 0
    total = 0
    loss_sum = 0.0
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            out = model(x)
            loss_sum += F.cross_entropy(out, y, reduction="sum").item()
            correct += (out.argmax(1) == y).sum().item()
            total += y.size(0)
    # gloo reduces host tensors directly
    stats = torch.tensor([loss_sum, correct, total], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    return stats[0].item() / stats[2].item(), stats[1].item() / stats[2].item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=20))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(0)

    tr_loader, te_loader, tr_sampler = loaders(args, rank, world)

    net = make_model().to(device)
    if rank == 0 and args.init_from:
        missing, unexpected = load_backbone(net, args.init_from)
        print(f"[rank0] loaded {args.init_from}: missing={len(missing)} unexpected={len(unexpected)}")
    # broadcast_buffers keeps BN running stats equal to rank 0's
    model = DDP(net, device_ids=[local_rank], broadcast_buffers=True)

    lr = args.lr * world  # linear scaling for the bigger global batch
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum,
                          weight_decay=args.wd, nesterov=True)
    warmup = 5 * len(tr_loader)
    total = args.epochs * len(tr_loader)
    sched = torch.optim.lr_scheduler.SequentialLR(
        opt,
        [torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=warmup),
         torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total - warmup)],
        milestones=[warmup],
    )

    best = 0.0
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        seen = 0
        loss_acc = 0.0
        for x, y in tr_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            out = model(x)
            loss = F.cross_entropy(out, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            loss_acc += loss.item() * y.size(0)
            seen += y.size(0)

        tr_stats = torch.tensor([loss_acc, seen], dtype=torch.float64)
        dist.all_reduce(tr_stats)
        te_loss, te_acc = evaluate(model, te_loader, device)
        if rank == 0:
            elapsed = time.time() - t0
            print(f"ep {epoch+1}/{args.epochs} train_loss {tr_stats[0]/tr_stats[1]:.3f} "
                  f"test_loss {te_loss:.3f} test_acc {te_acc:.4f} "
                  f"lr {sched.get_last_lr()[0]:.4f} ({elapsed:.0f}s, {seen*world/elapsed:.0f} img/s)")
            if te_acc > best:
                best = te_acc
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "acc": te_acc}, args.save)

    if rank == 0:
        print(f"best acc {best:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
