"""Data-parallel CNN training on Fashion-MNIST using only CPU cores.

Runs N worker processes on one machine with torch.multiprocessing and the
gloo backend; intended for the department's 64-core compute servers.

    python 06_cpu_spawn_fashion.py --procs 8 --threads-per-proc 8 --epochs 15
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
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

DATA_ROOT = os.path.expanduser("~/data/fashion_mnist")
MEAN, STD = (0.2860,), (0.3530,)


class SmallConvNet(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.conv3 = nn.Conv2d(64, 128, 3, padding=1)
        self.gn1 = nn.GroupNorm(8, 32)
        self.gn2 = nn.GroupNorm(8, 64)
        self.gn3 = nn.GroupNorm(8, 128)
        self.drop = nn.Dropout(0.25)
        self.fc1 = nn.Linear(128 * 3 * 3, 256)
        self.fc2 = nn.Linear(256, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.gn1(self.conv1(x))), 2)  # 14x14
        x = F.max_pool2d(F.relu(self.gn2(self.conv2(x))), 2)  # 7x7
        x = F.max_pool2d(F.relu(self.gn3(self.conv3(x))), 2)  # 3x3
        x = self.drop(torch.flatten(x, 1))
        x = self.drop(F.relu(self.fc1(x)))
        return self.fc2(x)


def get_datasets(download=False):
    train_tf = transforms.Compose([
        transforms.RandomCrop(28, padding=2),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(MEAN, STD),
    ])
    test_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    train = datasets.FashionMNIST(DATA_ROOT, train=True, download=download, transform=train_tf)
    test = datasets.FashionMNIST(DATA_ROOT, train=False, download=download, transform=test_tf)
    return train, test


def evaluate(model, loader):
    model.eval()
    correct = torch.zeros(1, dtype=torch.long)
    seen = torch.zeros(1, dtype=torch.long)
    loss_sum = torch.zeros(1, dtype=torch.float64)
    with torch.no_grad():
        for x, y in loader:
            out = model(x)
            loss_sum += F.cross_entropy(out, y, reduction="sum").item()
            correct += (out.argmax(1) == y).sum()
            seen += y.numel()
    for t in (correct, seen, loss_sum):
        dist.all_reduce(t)
    model.train()
    return loss_sum.item() / seen.item(), correct.item() / seen.item()


def worker(rank, world_size, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port)
    torch.set_num_threads(args.threads_per_proc)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(args.seed)

    train_set, test_set = get_datasets(download=False)
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    test_idx = list(range(rank, len(test_set), world_size))
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, num_workers=1)
    test_loader = DataLoader(torch.utils.data.Subset(test_set, test_idx), batch_size=1000, num_workers=1)

    model = DDP(SmallConvNet())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * world_size, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.lr * world_size, epochs=args.epochs, steps_per_epoch=len(train_loader))

    for epoch in range(1, args.epochs + 1):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for batch_idx, (x, y) in enumerate(train_loader):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if rank == 0 and batch_idx % 50 == 0:
                print(f"[epoch {epoch}] {batch_idx * len(x) * world_size:>6d}/{len(train_set)} "
                      f"loss {loss.item():.4f}", flush=True)

        test_loss, test_acc = evaluate(model, test_loader)
        if rank == 0:
            print(f"epoch {epoch}: test loss {test_loss:.4f} acc {test_acc * 100:.2f}% "
                  f"({time.time() - t0:.1f}s)", flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(),
                        "optimizer": optimizer.state_dict()}, args.checkpoint)

    dist.barrier()
    dist.destroy_process_group()


parser = argparse.ArgumentParser(description="Fashion-MNIST DDP on CPU")
parser.add_argument("--procs", type=int, default=8)
parser.add_argument("--threads-per-proc", type=int, default=8)
parser.add_argument("--batch-size", type=int, default=64, help="per process")
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--epochs", type=int, default=15)
parser.add_argument("--port", type=int, default=29533)
parser.add_argument("--seed", type=int, default=1)
parser.add_argument("--checkpoint", default="fashion_cnn.pt")
args = parser.parse_args()

# fetch once in the parent so the workers don't race on the download
get_datasets(download=True)
print(f"starting {args.procs} workers x {args.threads_per_proc} threads", flush=True)
mp.spawn(worker, args=(args.procs, args), nprocs=args.procs, join=True)
print("training finished", flush=True)
