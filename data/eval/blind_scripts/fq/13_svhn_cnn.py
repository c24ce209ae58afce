"""
SVHN digit classification (train + extra splits) with a 9-layer CNN.
Single node, one process per GPU, started with torch.multiprocessing.spawn.

    python 13_svhn_cnn.py --world-size 4 --use-extra
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def conv_bn(cin, cout, pool=False):
    layers = [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]
    if pool:
        layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers)


class SVHNNet(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.body = nn.Sequential(
            conv_bn(3, 64), conv_bn(64, 128, pool=True),
            conv_bn(128, 128), conv_bn(128, 128),
            conv_bn(128, 256, pool=True), conv_bn(256, 512, pool=True),
            conv_bn(512, 512), conv_bn(512, 512),
        )
        self.head = nn.Sequential(nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Dropout(0.2),
                                  nn.Linear(512, num_classes))

    def forward(self, x):
        return self.head(self.body(x))


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="./data/svhn")
    p.add_argument("--world-size", type=int, default=torch.cuda.device_count())
    p.add_argument("--use-extra", action="store_true")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--max-lr", type=float, default=0.01, help="for a total batch of 512")
    p.add_argument("--grad-clip", type=float, default=0.1)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--save", default="svhn_cnn.pth")
    p.add_argument("--port", type=int, default=29570)
    return p.parse_args()


def build_datasets(root, use_extra):
    stats = ((0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970))
    train_tf = transforms.Compose([
        transforms.RandomCrop(32, padding=2),
        transforms.ColorJitter(0.1, 0.1, 0.1),
        transforms.ToTensor(), transforms.Normalize(*stats),
    ])
    test_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(*stats)])
    train = datasets.SVHN(root, split="train", transform=train_tf)
    if use_extra:
        train = ConcatDataset([train, datasets.SVHN(root, split="extra", transform=train_tf)])
    test = datasets.SVHN(root, split="test", transform=test_tf)
    return train, test


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        out = model(x)
        acc[0] += F.cross_entropy(out, y, reduction="sum")
        acc[1] += (out.argmax(1) == y).sum()
        acc[2] += y.numel()
    dist.all_reduce(acc)
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def worker(rank, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=args.world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(0)

    train_ds, test_ds = build_datasets(args.data, args.use_extra)
    train_sampler = DistributedSampler(train_ds, num_replicas=args.world_size, rank=rank, shuffle=True)
    test_sampler = DistributedSampler(test_ds, num_replicas=args.world_size, rank=rank, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                          num_workers=args.workers, pin_memory=True, drop_last=True)
    test_dl = DataLoader(test_ds, batch_size=512, sampler=test_sampler,
                         num_workers=args.workers, pin_memory=True)

    model = SVHNNet().to(device)
    model = DDP(model, device_ids=[rank])

    max_lr = args.max_lr * args.batch_size * args.world_size / 512
    optimizer = torch.optim.Adam(model.parameters(), lr=max_lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=max_lr, epochs=args.epochs,
                                                steps_per_epoch=len(train_dl))

    best_acc, skipped = 0.0, 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            out = model(x)
            loss = F.cross_entropy(out, y)
            if not torch.isfinite(loss):
                skipped += 1
                print(f"[rank {rank}] non-finite loss at epoch {epoch} step {i}, skipping batch")
                continue
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_value_(model.parameters(), args.grad_clip)
            optimizer.step()
            sched.step()
            if rank == 0 and i % 200 == 0:
                print(f"epoch {epoch} [{i}/{len(train_dl)}] loss {loss.item():.4f} "
                      f"lr {sched.get_last_lr()[0]:.5f}")

        val_loss, val_acc = evaluate(model, test_dl, device)
        if rank == 0:
            print(f"== epoch {epoch}: val_loss {val_loss:.4f} val_acc {val_acc:.4f} "
                  f"time {time.time() - t0:.0f}s")
            if val_acc > best_acc:
                best_acc = val_acc
                torch.save(model.module.state_dict(), args.save)

    if skipped:
        print(f"[rank {rank}] skipped {skipped} batches in total")
    dist.destroy_process_group()


if __name__ == "__main__":
    args = get_args()
    for split in (["train", "test", "extra"] if args.use_extra else ["train", "test"]):
        datasets.SVHN(args.data, split=split, download=True)
    mp.spawn(worker, args=(args,), nprocs=args.world_size, join=True)
