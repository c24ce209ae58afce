"""
Fashion-MNIST classifier with a train / validation split, DDP version.

I keep 5000 images of the official training set as a validation set to pick
the best epoch, and only look at the official test set at the very end.

Launch:
    torchrun --nproc_per_node=4 08_fmnist_split_val.py --epochs 15
"""
import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, random_split
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data_dir", default="./data")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch_size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--val_size", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--save_path", default="fmnist_best.pt")
    return parser.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(32)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(64)
        self.conv3 = nn.Conv2d(64, 128, 3, padding=1)
        self.bn3 = nn.BatchNorm2d(128)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(128 * 3 * 3, 256)
        self.fc2 = nn.Linear(256, 10)
        self.dropout = nn.Dropout(0.4)

    def forward(self, x):
        x = self.pool(F.relu(self.bn1(self.conv1(x))))   # 14x14
        x = self.pool(F.relu(self.bn2(self.conv2(x))))   # 7x7
        x = self.pool(F.relu(self.bn3(self.conv3(x))))   # 3x3
        x = x.flatten(1)
        x = self.dropout(F.relu(self.fc1(x)))
        return self.fc2(x)


def reduce_sum(value, device):
    t = torch.tensor(value, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.item()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    loss_sum, correct, n = 0.0, 0, 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        out = model(x)
        loss_sum += F.cross_entropy(out, y, reduction="sum").item()
        correct += (out.argmax(1) == y).sum().item()
        n += y.size(0)
    # sum over all ranks
    loss_sum = reduce_sum(loss_sum, device)
    correct = reduce_sum(correct, device)
    n = reduce_sum(n, device)
    return loss_sum / n, correct / n


def main():
    args = get_args()

    # --- distributed setup -------------------------------------------------
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    # different seed per process so that dropout / augmentation differ between GPUs
    set_seed(args.seed + rank)

    # --- data ----------------------------------------------------------------
    train_tf = transforms.Compose([
        transforms.RandomHorizontalFlip(),
        transforms.RandomAffine(degrees=10, translate=(0.1, 0.1)),
        transforms.ToTensor(),
        transforms.Normalize((0.2860,), (0.3530,)),
    ])
    test_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.2860,), (0.3530,))])

    if rank == 0:
        datasets.FashionMNIST(args.data_dir, train=True, download=True)
        datasets.FashionMNIST(args.data_dir, train=False, download=True)
    dist.barrier()

    full_train = datasets.FashionMNIST(args.data_dir, train=True, transform=train_tf)
    test_set = datasets.FashionMNIST(args.data_dir, train=False, transform=test_tf)

    n_train = len(full_train) - args.val_size
    train_set, val_set = random_split(full_train, [n_train, args.val_size])
    # (the val subset shares the train transform, good enough for model selection)

    train_sampler = DistributedSampler(train_set, shuffle=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    test_sampler = DistributedSampler(test_set, shuffle=False)

    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True)
    val_loader = DataLoader(val_set, batch_size=512, sampler=val_sampler, num_workers=2)
    test_loader = DataLoader(test_set, batch_size=512, sampler=test_sampler, num_workers=2)

    if rank == 0:
        print(f"train {len(train_set)} | val {len(val_set)} | test {len(test_set)} | world {world_size}")

    # --- model ---------------------------------------------------------------
    model = ConvNet().to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * world_size)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.5, patience=2)

    # --- training --------------------------------------------------------------
    best_val_acc = 0.0
    for epoch in range(1, args.epochs + 1):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            if rank == 0 and step % 50 == 0:
                print(f"epoch {epoch} step {step}/{len(train_loader)} loss {loss.item():.4f}")

        val_loss, val_acc = evaluate(model, val_loader, device)
        scheduler.step(val_loss)   # same val_loss on every rank -> same lr everywhere

        if rank == 0:
            print(f"[epoch {epoch}] val loss {val_loss:.4f} val acc {val_acc * 100:.2f}% "
                  f"lr {optimizer.param_groups[0]['lr']:.2e} ({time.time() - t0:.1f}s)")
            if val_acc > best_val_acc:
                best_val_acc = val_acc
                torch.save(model.module.state_dict(), args.save_path)
                print(f"  new best, saved to {args.save_path}")
        dist.barrier()

    # --- final test with the best weights ----------------------------------------
    state = torch.load(args.save_path, map_location=device)
    model.module.load_state_dict(state)
    test_loss, test_acc = evaluate(model, test_loader, device)
    if rank == 0:
        print(f"best val acc {best_val_acc * 100:.2f}% -> test acc {test_acc * 100:.2f}%")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
