"""CIFAR-10 with a small VGG, single node multi-GPU via torch.multiprocessing.spawn.

    python 14_cifar10_spawn.py --gpus 4 --epochs 60 --batch-size 128
"""
import argparse
import os
import socket
import time
from contextlib import closing

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

CFG_VGG11 = [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]


class VGG(nn.Module):
    def __init__(self, cfg=CFG_VGG11, num_classes=10):
        super().__init__()
        layers, c = [], 3
        for v in cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(c, v, 3, padding=1), nn.BatchNorm2d(v), nn.ReLU(inplace=True)]
                c = v
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(512, num_classes)

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


def find_free_port():
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}",
                            rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    norm = T.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    train_set = torchvision.datasets.CIFAR10(args.data, train=True,
                                             transform=T.Compose([T.RandomCrop(32, padding=4),
                                                                  T.RandomHorizontalFlip(),
                                                                  T.ToTensor(), norm]))
    test_set = torchvision.datasets.CIFAR10(args.data, train=False, transform=T.Compose([T.ToTensor(), norm]))
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    test_sampler = DistributedSampler(test_set, num_replicas=world_size, rank=rank, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=500, sampler=test_sampler, num_workers=4, pin_memory=True)

    model = VGG().to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[rank], output_device=rank)

    # lr given for a global batch of 128; scaled linearly with the global batch
    global_bs = args.batch_size * world_size
    lr = args.lr * global_bs / 128
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    steps_per_epoch = len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, epochs=args.epochs,
                                                    steps_per_epoch=steps_per_epoch, pct_start=0.15)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            out = model(x)
            loss = F.cross_entropy(out, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            running[0] += loss.detach() * x.size(0)
            running[1] += x.size(0)
        dist.all_reduce(running)

        model.eval()
        hits = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in test_loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                hits[0] += (model(x).argmax(1) == y).sum()
                hits[1] += y.numel()
        dist.all_reduce(hits)

        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs} loss {(running[0] / running[1]).item():.4f} "
                  f"acc {(100 * hits[0] / hits[1]).item():.2f}% lr {scheduler.get_last_lr()[0]:.4f} "
                  f"{time.time() - t0:.1f}s")
            if (epoch + 1) % args.save_every == 0 or epoch + 1 == args.epochs:
                torch.save({"epoch": epoch, "model": model.module.state_dict(),
                            "optimizer": optimizer.state_dict()},
                           os.path.join(args.out, f"vgg11_ep{epoch + 1}.pt"))

    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    parser.add_argument("--data", default="./data")
    parser.add_argument("--out", default="./checkpoints")
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=128, help="per GPU")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    os.makedirs(args.out, exist_ok=True)
    # download once in the parent, before any worker starts
    torchvision.datasets.CIFAR10(args.data, train=True, download=True)
    torchvision.datasets.CIFAR10(args.data, train=False, download=True)
    args.port = find_free_port()

    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
