"""
Fashion-MNIST: train with DDP, then reload the best weights and test them
the way the grading script does (plain model, single GPU).

    torchrun --nproc_per_node=4 20_fmnist_train_then_test.py --epochs 10
"""
import argparse
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

LABELS = ["T-shirt", "Trouser", "Pullover", "Dress", "Coat",
          "Sandal", "Shirt", "Sneaker", "Bag", "Boot"]


class FashionNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(32)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(64)
        self.fc1 = nn.Linear(64 * 7 * 7, 256)
        self.fc2 = nn.Linear(256, 10)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        x = torch.flatten(x, 1)
        x = self.drop(F.relu(self.fc1(x)))
        return self.fc2(x)


def build_transform(train):
    t = [transforms.ToTensor(), transforms.Normalize((0.5,), (0.5,))]
    if train:
        t = [transforms.RandomHorizontalFlip()] + t
    return transforms.Compose(t)


def train_one_epoch(model, loader, optimizer, device, epoch, rank):
    model.train()
    running = 0.0
    for i, (x, y) in enumerate(loader):
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        running += loss.item()
        if rank == 0 and (i + 1) % 100 == 0:
            print(f"[epoch {epoch}] step {i + 1}/{len(loader)} loss {running / 100:.4f}")
            running = 0.0


@torch.no_grad()
def dist_accuracy(model, loader, device):
    model.eval()
    c = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        c[0] += (model(x).argmax(1) == y).sum()
        c[1] += y.numel()
    dist.all_reduce(c)
    return (c[0] / c[1]).item()


@torch.no_grad()
def final_test(weights_path, data_dir, device):
    """Same as the course grading script: fresh model, load weights, full test set."""
    net = FashionNet().to(device)
    net.load_state_dict(torch.load(weights_path, map_location=device))
    net.eval()
    test_set = datasets.FashionMNIST(data_dir, train=False, transform=build_transform(False))
    loader = DataLoader(test_set, batch_size=1000, shuffle=False)
    class_correct = [0] * 10
    class_total = [0] * 10
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        pred = net(x).argmax(1)
        for label, p in zip(y.tolist(), pred.tolist()):
            class_total[label] += 1
            class_correct[label] += int(label == p)
    for i in range(10):
        print(f"  {LABELS[i]:>8s}: {100.0 * class_correct[i] / class_total[i]:.1f}%")
    print(f"overall: {100.0 * sum(class_correct) / sum(class_total):.2f}%")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="./data")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.001)
    parser.add_argument("--save-path", default="fashion_best.pth")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    if rank == 0:
        datasets.FashionMNIST(args.data, train=True, download=True)
        datasets.FashionMNIST(args.data, train=False, download=True)
    dist.barrier()

    train_set = datasets.FashionMNIST(args.data, train=True, transform=build_transform(True))
    test_set = datasets.FashionMNIST(args.data, train=False, transform=build_transform(False))
    train_sampler = DistributedSampler(train_set, shuffle=True)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=2, pin_memory=True)
    test_loader = DataLoader(test_set, batch_size=500, sampler=test_sampler, num_workers=2)

    model = FashionNet().to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * world_size)

    best = 0.0
    for epoch in range(1, args.epochs + 1):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        train_one_epoch(model, train_loader, optimizer, device, epoch, rank)
        acc = dist_accuracy(model, test_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: test acc {acc * 100:.2f}% ({time.time() - t0:.1f}s)")
            if acc > best:
                best = acc
                torch.save(model.state_dict(), args.save_path)
                print(f"  saved best model to {args.save_path}")

    dist.barrier()
    if rank == 0:
        print(f"\nbest test acc during training: {best * 100:.2f}%")
        print("re-testing the saved weights with a plain model:")
        final_test(args.save_path, args.data, device)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
