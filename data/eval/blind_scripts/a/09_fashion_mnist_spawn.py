# Multi-GPU training of a small CNN on Fashion-MNIST, one process per GPU via mp.spawn.
#
#   python train_fmnist.py --epochs 30 --batch-size 128
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


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2), nn.Dropout(0.25),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2), nn.Dropout(0.25))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(64 * 7 * 7, 256), nn.ReLU(),
                                        nn.Dropout(0.5), nn.Linear(256, 10))

    def forward(self, x):
        return self.classifier(self.features(x))


def setup(rank, world_size, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)


def cleanup():
    dist.destroy_process_group()


def test(model, loader, device):
    model.eval()
    totals = torch.zeros(3, device=device)
    with torch.no_grad():
        for data, target in loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            totals[0] += F.cross_entropy(output, target, reduction="sum")
            totals[1] += (output.argmax(dim=1) == target).sum()
            totals[2] += target.size(0)
    dist.all_reduce(totals)
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def train(rank, world_size, args):
    setup(rank, world_size, args.port)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.2860,), (0.3530,))])
    train_set = datasets.FashionMNIST(args.data, train=True, download=False, transform=tf)
    test_set = datasets.FashionMNIST(args.data, train=False, download=False, transform=tf)
    test_set = torch.utils.data.Subset(test_set, range(rank, len(test_set), world_size))

    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=2, pin_memory=True)
    test_loader = DataLoader(test_set, batch_size=1000, num_workers=2)

    model = DDP(Net().to(device), device_ids=[rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * world_size)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.3)

    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for batch_idx, (data, target) in enumerate(train_loader):
            data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
            if rank == 0 and batch_idx % args.log_interval == 0:
                print(f"Train Epoch: {epoch} [{batch_idx * len(data) * world_size}/{len(train_set)}]"
                      f"\tLoss: {loss.item():.6f}")
        scheduler.step()
        test_loss, acc = test(model, test_loader, device)
        if rank == 0:
            print(f"Epoch {epoch}: test loss {test_loss:.4f}, accuracy {100 * acc:.2f}% "
                  f"({time.time() - t0:.1f}s)")

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        torch.save(model.module.state_dict(), os.path.join(args.save_dir, "fmnist_cnn.pt"))
    dist.barrier()
    cleanup()


parser = argparse.ArgumentParser(description="Fashion-MNIST DDP")
parser.add_argument("--data", default="./data")
parser.add_argument("--batch-size", type=int, default=128)
parser.add_argument("--epochs", type=int, default=30)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--seed", type=int, default=1)
parser.add_argument("--log-interval", type=int, default=100)
parser.add_argument("--port", type=int, default=29517)
parser.add_argument("--save-dir", default="./models")
args = parser.parse_args()

# download once in the parent so the workers don't race on the files
datasets.FashionMNIST(args.data, train=True, download=True)
datasets.FashionMNIST(args.data, train=False, download=True)

world_size = torch.cuda.device_count()
print(f"Spawning {world_size} processes")
mp.spawn(train, args=(world_size, args), nprocs=world_size, join=True)
