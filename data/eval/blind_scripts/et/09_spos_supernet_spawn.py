"""One-shot supernet (uniform single-path sampling) on CIFAR-100, single node.

Started with plain `python`; one process per visible GPU is spawned.
Rank 0 draws the path of each step and broadcasts it, so all replicas
train the same path.

    python 09_spos_supernet_spawn.py --data ./data --epochs 200 --out runs/spos_c100
"""
import argparse
import os
import random
import socket

import numpy as np
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

OPS = ["conv3x3", "conv5x5", "sep3x3", "sep5x5", "identity"]
N_LAYERS = 12


def conv_bn(cin, cout, k, groups=1):
    return nn.Sequential(nn.Conv2d(cin, cout, k, padding=k // 2, groups=groups, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


def make_candidate(name, c):
    if name == "conv3x3":
        return conv_bn(c, c, 3)
    if name == "conv5x5":
        return conv_bn(c, c, 5)
    if name == "sep3x3":
        return nn.Sequential(conv_bn(c, c, 3, groups=c), conv_bn(c, c, 1))
    if name == "sep5x5":
        return nn.Sequential(conv_bn(c, c, 5, groups=c), conv_bn(c, c, 1))
    return nn.Identity()


class SuperNet(nn.Module):
    def __init__(self, num_classes=100, width=64):
        super().__init__()
        self.stem = conv_bn(3, width, 3)
        self.layers = nn.ModuleList()
        self.downsample = nn.ModuleDict()
        c = width
        for i in range(N_LAYERS):
            if i in (4, 8):
                self.downsample[str(i)] = nn.Sequential(nn.Conv2d(c, 2 * c, 1, 2, bias=False), nn.BatchNorm2d(2 * c))
                c *= 2
            self.layers.append(nn.ModuleList([make_candidate(o, c) for o in OPS]))
        self.fc = nn.Linear(c, num_classes)

    def forward(self, x, path):
        x = self.stem(x)
        for i, (layer, op) in enumerate(zip(self.layers, path)):
            if str(i) in self.downsample:
                x = self.downsample[str(i)](x)
            x = layer[op](x)
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank, world_size, port, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    # per-rank seed only affects augmentation and the path draw on rank 0
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    mean, std = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
    train_set = torchvision.datasets.CIFAR100(args.data, train=True, download=False, transform=T.Compose([
        T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(mean, std)]))
    test_set = torchvision.datasets.CIFAR100(args.data, train=False, download=False, transform=T.Compose([
        T.ToTensor(), T.Normalize(mean, std)]))
    train_sampler = DistributedSampler(train_set, world_size, rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=4,
                              pin_memory=True, drop_last=True)
    test_loader = DataLoader(torch.utils.data.Subset(test_set, range(rank, len(test_set), world_size)),
                             500, num_workers=4, pin_memory=True)

    model = SuperNet().to(device)
    # only one candidate per layer runs in a step, the rest get no gradient
    ddp = DDP(model, device_ids=[rank], find_unused_parameters=True)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr * world_size, momentum=0.9,
                                weight_decay=5e-4, nesterov=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs)

    start_epoch = 0
    ckpt_path = os.path.join(args.out, "supernet.pt")
    if args.resume and os.path.exists(ckpt_path):
        state = torch.load(ckpt_path, map_location=device)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch = state["epoch"] + 1

    path_buf = torch.empty(N_LAYERS, dtype=torch.long, device=device)
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        ddp.train()
        meter = torch.zeros(2, device=device)
        for step, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if rank == 0:
                path_buf.copy_(torch.tensor([random.randrange(len(OPS)) for _ in range(N_LAYERS)]))
            dist.broadcast(path_buf, src=0)
            path = path_buf.tolist()

            loss = F.cross_entropy(ddp(x, path), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            meter += torch.stack([loss.detach(), torch.ones((), device=device)])
        scheduler.step()

        dist.all_reduce(meter)
        # fixed probe path, same on every rank
        probe = [i % len(OPS) for i in range(N_LAYERS)]
        ddp.eval()
        correct = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in test_loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                correct[0] += (model(x, probe).argmax(1) == y).sum()
                correct[1] += y.numel()
        dist.all_reduce(correct)

        if rank == 0:
            print(f"epoch {epoch}: train loss {(meter[0] / meter[1]).item():.4f} "
                  f"probe acc {(100 * correct[0] / correct[1]).item():.2f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="./data")
    parser.add_argument("--out", default="runs/spos_c100")
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=128, help="per GPU")
    parser.add_argument("--lr", type=float, default=0.05, help="per 128 images")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    world_size = torch.cuda.device_count()
    port = free_port()
    mp.spawn(worker, args=(world_size, port, args), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
