"""
EMNIST 'balanced' (47 classes) with a LeNet-5 style network.
Multi-GPU data parallel training, one process per GPU started by mp.spawn.

    python 16_emnist_lenet.py --n_gpus 4 --epochs 25
"""
import argparse
import json
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


def get_config():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data_root", type=str, default="./data")
    parser.add_argument("--n_gpus", type=int, default=torch.cuda.device_count())
    parser.add_argument("--epochs", type=int, default=25)
    parser.add_argument("--batch_size", type=int, default=256, help="per GPU")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight_decay", type=float, default=5e-4)
    parser.add_argument("--num_workers", type=int, default=4)
    parser.add_argument("--output_dir", type=str, default="./emnist_out")
    parser.add_argument("--master_port", type=str, default="29588")
    return parser.parse_args()


class LeNet5(nn.Module):
    def __init__(self, num_classes=47):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, kernel_size=5, padding=2)
        self.bn1 = nn.BatchNorm2d(32)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=5)
        self.bn2 = nn.BatchNorm2d(64)
        self.fc1 = nn.Linear(64 * 5 * 5, 256)
        self.fc2 = nn.Linear(256, 128)
        self.fc3 = nn.Linear(128, num_classes)
        self.dropout = nn.Dropout(0.3)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        x = x.flatten(1)
        x = self.dropout(F.relu(self.fc1(x)))
        x = self.dropout(F.relu(self.fc2(x)))
        return self.fc3(x)


def init_distributed(rank, world_size, port):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = port
    torch.cuda.set_device(rank)
    dist.init_process_group(backend="nccl", rank=rank, world_size=world_size)


def fix_orientation(img):
    # EMNIST images are stored transposed relative to MNIST
    return img.transpose(1, 2)


def make_loaders(cfg, rank, world_size):
    train_tf = transforms.Compose([
        transforms.RandomAffine(degrees=10, translate=(0.1, 0.1)),
        transforms.ToTensor(),
        transforms.Lambda(fix_orientation),
        transforms.Normalize((0.1751,), (0.3332,)),
    ])
    test_tf = transforms.Compose([
        transforms.ToTensor(),
        transforms.Lambda(fix_orientation),
        transforms.Normalize((0.1751,), (0.3332,)),
    ])
    train_set = datasets.EMNIST(cfg.data_root, split="balanced", train=True, transform=train_tf)
    test_set = datasets.EMNIST(cfg.data_root, split="balanced", train=False, transform=test_tf)

    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, shuffle=True,
                              num_workers=cfg.num_workers, pin_memory=True, drop_last=True)
    test_sampler = DistributedSampler(test_set, num_replicas=world_size, rank=rank, shuffle=False)
    test_loader = DataLoader(test_set, batch_size=1024, sampler=test_sampler,
                             num_workers=cfg.num_workers, pin_memory=True)
    return train_loader, test_loader


def evaluate(model, loader, device):
    model.eval()
    totals = torch.zeros(3, device=device)
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            totals[0] += F.cross_entropy(logits, y, reduction="sum")
            totals[1] += (logits.argmax(dim=1) == y).sum()
            totals[2] += y.size(0)
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def train(rank, world_size, cfg):
    init_distributed(rank, world_size, cfg.master_port)
    device = torch.device("cuda", rank)
    torch.manual_seed(1234)

    train_loader, test_loader = make_loaders(cfg, rank, world_size)
    model = DDP(LeNet5().to(device), device_ids=[rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.epochs)

    history = []
    best_acc = 0.0
    for epoch in range(cfg.epochs):
        model.train()
        t0 = time.time()
        loss_acc = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_acc[0] += loss.detach()
            loss_acc[1] += 1
        scheduler.step()
        dist.all_reduce(loss_acc)
        train_loss = (loss_acc[0] / loss_acc[1]).item()
        test_loss, test_acc = evaluate(model, test_loader, device)

        if rank == 0:
            dt = time.time() - t0
            print(f"epoch {epoch + 1:02d} | train_loss {train_loss:.4f} | test_loss {test_loss:.4f} "
                  f"| test_acc {test_acc:.4f} | {dt:.1f}s")
            history.append({"epoch": epoch + 1, "train_loss": train_loss,
                            "test_loss": test_loss, "test_acc": test_acc, "time": dt})
            if test_acc > best_acc:
                best_acc = test_acc
                torch.save(model.module.state_dict(), os.path.join(cfg.output_dir, "lenet5_emnist.pt"))

    if rank == 0:
        with open(os.path.join(cfg.output_dir, "history.json"), "w") as f:
            json.dump(history, f, indent=2)
        print(f"best test acc: {best_acc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    cfg = get_config()
    os.makedirs(cfg.output_dir, exist_ok=True)
    datasets.EMNIST(cfg.data_root, split="balanced", train=True, download=True)
    datasets.EMNIST(cfg.data_root, split="balanced", train=False, download=True)
    mp.spawn(train, args=(cfg.n_gpus, cfg), nprocs=cfg.n_gpus, join=True)
