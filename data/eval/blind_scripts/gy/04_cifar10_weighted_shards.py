#!/usr/bin/env python3
# CIFAR-10 / ResNet-ish from scratch, 2 boxes on the home LAN.
#
# box0 = RTX 3090 (master, 10.0.0.2), box1 = RTX 2070 (10.0.0.3)
# The 2070 is a lot slower, so instead of an even split each rank gets a
# share of the epoch proportional to --speed (measured with bench_fwd.py).
#
#   box0$ torchrun --nnodes 2 --nproc_per_node 1 --node_rank 0 \
#             --master_addr 10.0.0.2 --master_port 29500 cifar10_ddp.py --speed 1.0,0.55
#   box1$ torchrun --nnodes 2 --nproc_per_node 1 --node_rank 1 \
#             --master_addr 10.0.0.2 --master_port 29500 cifar10_ddp.py --speed 1.0,0.55

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset


def conv_bn(cin, cout, pool=False):
    layers = [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]
    if pool:
        layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers)


class Residual(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.a = conv_bn(ch, ch)
        self.b = conv_bn(ch, ch)

    def forward(self, x):
        return x + self.b(self.a(x))


class ResNet9(nn.Module):
    """The DAWNBench ResNet-9."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.net = nn.Sequential(
            conv_bn(3, 64),
            conv_bn(64, 128, pool=True),
            Residual(128),
            conv_bn(128, 256, pool=True),
            conv_bn(256, 512, pool=True),
            Residual(512),
            nn.AdaptiveMaxPool2d(1),
            nn.Flatten(),
            nn.Linear(512, num_classes),
        )

    def forward(self, x):
        return self.net(x) * 0.125


def shard_indices(n, rank, speeds, epoch, seed=0):
    """Shuffle 0..n-1 (same permutation on every rank) and cut it into pieces
    whose sizes follow the relative speed of each GPU."""
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    perm = torch.randperm(n, generator=g).tolist()
    total = sum(speeds)
    bounds = [0]
    for s in speeds:
        bounds.append(bounds[-1] + int(n * s / total))
    bounds[-1] = n
    return perm[bounds[rank]:bounds[rank + 1]]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default=os.path.expanduser("~/data/cifar10"))
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--bs", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.4)
    p.add_argument("--wd", type=float, default=5e-4)
    p.add_argument("--speed", default="1.0,1.0", help="relative speed per rank, comma separated")
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--ckpt", default="resnet9_cifar10.pt")
    return p.parse_args()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    speeds = [float(s) for s in args.speed.split(",")]
    assert len(speeds) == world, f"--speed needs {world} entries"

    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    train_tf = T.Compose([T.RandomCrop(32, padding=4, padding_mode="reflect"),
                          T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(mean, std)])
    test_tf = T.Compose([T.ToTensor(), T.Normalize(mean, std)])
    train_full = torchvision.datasets.CIFAR10(args.root, train=True, transform=train_tf)
    test_set = torchvision.datasets.CIFAR10(args.root, train=False, transform=test_tf)

    model = ResNet9().to(dev).to(memory_format=torch.channels_last)
    model = DDP(model, device_ids=[local_rank])

    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True,
                          weight_decay=args.wd)
    # generous bound so OneCycleLR never steps past its end
    max_steps = len(train_full) // args.bs + 1
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs,
                                                steps_per_epoch=max_steps, pct_start=0.25)
    scaler = torch.cuda.amp.GradScaler()

    for epoch in range(args.epochs):
        idx = shard_indices(len(train_full), rank, speeds, epoch)
        loader = DataLoader(Subset(train_full, idx), batch_size=args.bs, shuffle=False,
                            num_workers=args.workers, pin_memory=True, drop_last=True)
        model.train()
        t0 = time.time()
        stats = torch.zeros(3, device=dev)  # loss sum, correct, count
        for x, y in loader:
            x = x.to(dev, non_blocking=True).to(memory_format=torch.channels_last)
            y = y.to(dev, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(x)
                loss = F.cross_entropy(out, y, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            stats[0] += loss.detach() * y.numel()
            stats[1] += (out.argmax(1) == y).sum()
            stats[2] += y.numel()
        dist.all_reduce(stats)
        epoch_time = time.time() - t0

        # quick test pass on rank 0 only, everyone else waits
        if rank == 0:
            model.eval()
            correct = total = 0
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
                test_loader = DataLoader(test_set, batch_size=512, num_workers=4)
                for x, y in test_loader:
                    x = x.to(dev).to(memory_format=torch.channels_last)
                    y = y.to(dev)
                    correct += (model.module(x).argmax(1) == y).sum().item()
                    total += y.numel()
            print(f"epoch {epoch + 1:2d}  loss {stats[0] / stats[2]:.3f}  "
                  f"train acc {stats[1] / stats[2]:.3f}  test acc {correct / total:.4f}  "
                  f"lr {sched.get_last_lr()[0]:.3f}  {epoch_time:.1f}s", flush=True)
        dist.barrier()

    if rank == 0:
        torch.save(model.module.state_dict(), args.ckpt)
        print("saved", args.ckpt)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
