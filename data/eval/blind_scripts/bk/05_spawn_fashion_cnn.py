"""
Synchronous data-parallel SGD on Fashion-MNIST, written against the raw
torch.distributed API (the way the PyTorch "Writing Distributed Applications"
tutorial does it) and started with torch.multiprocessing.spawn.

    python 05_spawn_fashion_cnn.py --gpus 4 --epochs 30
"""
import argparse
import os
import random
import socket
import time
from dataclasses import dataclass, asdict

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


@dataclass
class Config:
    data_root: str = "./data"
    ckpt_dir: str = "./checkpoints/fashion"
    epochs: int = 30
    batch_size: int = 128
    lr: float = 0.02
    momentum: float = 0.9
    seed: int = 17
    master_addr: str = "127.0.0.1"
    master_port: int = 29512
    log_interval: int = 50


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.conv3 = nn.Conv2d(64, 128, 3, padding=1)
        self.drop = nn.Dropout(0.3)
        self.fc1 = nn.Linear(128 * 3 * 3, 256)
        self.fc2 = nn.Linear(256, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)   # 14
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)   # 7
        x = F.max_pool2d(F.relu(self.conv3(x)), 2)   # 3
        x = self.drop(torch.flatten(x, 1))
        return self.fc2(self.drop(F.relu(self.fc1(x))))


def average_gradients(model):
    size = float(dist.get_world_size())
    for param in model.parameters():
        if param.grad is None:
            continue
        dist.all_reduce(param.grad.data, op=dist.ReduceOp.SUM)
        param.grad.data /= size


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def run(rank, world_size, cfg):
    os.environ["MASTER_ADDR"] = cfg.master_addr
    os.environ["MASTER_PORT"] = str(cfg.master_port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    seed_everything(cfg.seed)

    tf_train = transforms.Compose([
        transforms.RandomCrop(28, padding=2),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize((0.2860,), (0.3530,)),
    ])
    tf_test = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.2860,), (0.3530,))])
    train_ds = datasets.FashionMNIST(cfg.data_root, train=True, transform=tf_train, download=False)
    test_ds = datasets.FashionMNIST(cfg.data_root, train=False, transform=tf_test, download=False)

    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg.seed)
    test_sampler = DistributedSampler(test_ds, num_replicas=world_size, rank=rank, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=train_sampler,
                              num_workers=2, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_ds, batch_size=500, sampler=test_sampler, num_workers=2)

    model = Net().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr * world_size, momentum=cfg.momentum,
                                weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.epochs)

    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        start = time.time()
        epoch_loss = torch.zeros(1, device=device)
        for batch_idx, (data, target) in enumerate(train_loader):
            data, target = data.to(device), target.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            average_gradients(model)
            optimizer.step()
            epoch_loss += loss.detach()
            if rank == 0 and batch_idx % cfg.log_interval == 0:
                print(f"Rank 0 | epoch {epoch} [{batch_idx * len(data) * world_size}/{len(train_ds)}] "
                      f"loss {loss.item():.4f}", flush=True)
        scheduler.step()

        dist.all_reduce(epoch_loss)
        epoch_loss /= world_size * len(train_loader)

        model.eval()
        counts = torch.zeros(2, device=device)
        with torch.no_grad():
            for data, target in test_loader:
                data, target = data.to(device), target.to(device)
                counts[0] += (model(data).argmax(1) == target).sum()
                counts[1] += target.numel()
        dist.all_reduce(counts)
        if rank == 0:
            print(f"epoch {epoch}: loss {epoch_loss.item():.4f} test acc "
                  f"{(counts[0] / counts[1]).item():.4f} ({time.time() - start:.1f}s)", flush=True)
            os.makedirs(cfg.ckpt_dir, exist_ok=True)
            torch.save({"epoch": epoch, "model": model.state_dict(), "cfg": asdict(cfg)},
                       os.path.join(cfg.ckpt_dir, f"epoch{epoch:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    parser.add_argument("--epochs", type=int, default=Config.epochs)
    parser.add_argument("--batch-size", type=int, default=Config.batch_size)
    parser.add_argument("--lr", type=float, default=Config.lr)
    parser.add_argument("--data-root", default=Config.data_root)
    opts = parser.parse_args()

    cfg = Config(data_root=opts.data_root, epochs=opts.epochs, batch_size=opts.batch_size,
                 lr=opts.lr, master_port=free_port())
    # fetch the dataset once before the workers start
    datasets.FashionMNIST(cfg.data_root, train=True, download=True)
    datasets.FashionMNIST(cfg.data_root, train=False, download=True)

    world_size = opts.gpus
    print(f"spawning {world_size} workers, config: {asdict(cfg)}")
    mp.spawn(run, args=(cfg, world_size), nprocs=world_size, join=True)
