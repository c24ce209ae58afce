#!/usr/bin/env python3
"""
CIFAR-100 ResNet-18 training, one process per GPU started with torch.multiprocessing.spawn.

    python 18_cifar_resnet_spawn.py --epochs 200 --batch-size 128
"""
import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

CIFAR_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR_STD = (0.2673, 0.2564, 0.2762)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def resnet18_cifar(num_classes=100):
    m = torchvision.models.resnet18(num_classes=num_classes)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


def build_data(root, rank, world, batch_size, workers):
    train_tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(),
                          T.Normalize(CIFAR_MEAN, CIFAR_STD)])
    test_tf = T.Compose([T.ToTensor(), T.Normalize(CIFAR_MEAN, CIFAR_STD)])
    train_set = torchvision.datasets.CIFAR100(root, train=True, transform=train_tf, download=False)
    test_set = torchvision.datasets.CIFAR100(root, train=False, transform=test_tf, download=False)
    train_sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True)
    test_subset = torch.utils.data.Subset(test_set, range(rank, len(test_set), world))
    train_loader = DataLoader(train_set, batch_size=batch_size, sampler=train_sampler, num_workers=workers,
                              pin_memory=True, drop_last=True, persistent_workers=workers > 0)
    test_loader = DataLoader(test_subset, batch_size=256, shuffle=False, num_workers=workers)
    return train_loader, test_loader, train_sampler


def evaluate(model, loader, device):
    model.eval()
    t = torch.zeros(3, device=device)
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(x)
            t[0] += F.cross_entropy(out.float(), y, reduction="sum")
            t[1] += (out.argmax(1) == y).sum()
            t[2] += y.size(0)
    dist.all_reduce(t)
    model.train()
    return (t[0] / t[2]).item(), (t[1] / t[2]).item()


def worker(rank, world_size, port, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    train_loader, test_loader, train_sampler = build_data(args.data, rank, world_size,
                                                          args.batch_size, args.workers)
    model = resnet18_cifar()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device).to(memory_format=torch.channels_last)
    model = DDP(model, device_ids=[rank])

    # linear scaling: --lr is for a total batch of 128
    lr = args.lr * args.batch_size * world_size / 128
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, epochs=args.epochs,
                                                    steps_per_epoch=len(train_loader), pct_start=0.15)
    scaler = torch.amp.GradScaler("cuda")

    start_epoch = 0
    ckpt_file = os.path.join(args.out, "checkpoint.pt")
    if args.resume and os.path.isfile(ckpt_file):
        ckpt = torch.load(ckpt_file, map_location={"cuda:0": f"cuda:{rank}"})
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"] + 1

    writer = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        stats = torch.zeros(2, device=device)
        for x, y in train_loader:
            x = x.to(device, non_blocking=True).to(memory_format=torch.channels_last)
            y = y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            stats += torch.stack([loss.detach().float(), torch.ones((), device=device)])

        dist.all_reduce(stats)
        test_loss, test_acc = evaluate(model.module, test_loader, device)
        if rank == 0:
            train_loss = (stats[0] / stats[1]).item()
            print(f"epoch {epoch:3d} train {train_loss:.3f} test {test_loss:.3f} acc {test_acc * 100:.2f}% "
                  f"{time.time() - t0:.1f}s", flush=True)
            writer.add_scalar("loss/train", train_loss, epoch)
            writer.add_scalar("loss/test", test_loss, epoch)
            writer.add_scalar("acc/test", test_acc, epoch)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "epoch": epoch},
                       ckpt_file)
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="./data")
    parser.add_argument("--out", default="./runs/cifar100_r18")
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=128, help="per GPU")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    os.makedirs(args.out, exist_ok=True)
    # download once in the parent, before any worker starts
    torchvision.datasets.CIFAR100(args.data, train=True, download=True)
    torchvision.datasets.CIFAR100(args.data, train=False, download=True)

    world_size = torch.cuda.device_count()
    port = free_port()
    mp.spawn(worker, args=(world_size, port, args), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
