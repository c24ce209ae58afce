"""MNIST ConvNet with DistributedDataParallel started by torch.multiprocessing.spawn.

    python 08_mnist_spawn.py            # uses every visible GPU
"""
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

CONFIG = {
    "batch_size": 64,
    "test_batch_size": 1000,
    "epochs": 14,
    "lr": 1.0,
    "gamma": 0.7,
    "seed": 1,
    "log_interval": 50,
    "data_dir": "./data",
    "save_path": "mnist_cnn.pt",
    "master_addr": "localhost",
    "master_port": "12355",
}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def setup(rank, world_size):
    os.environ["MASTER_ADDR"] = CONFIG["master_addr"]
    os.environ["MASTER_PORT"] = CONFIG["master_port"]
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)


def cleanup():
    dist.destroy_process_group()


def train_one_epoch(model, device, loader, optimizer, epoch, rank):
    model.train()
    for batch_idx, (data, target) in enumerate(loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        if rank == 0 and batch_idx % CONFIG["log_interval"] == 0:
            print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(loader.sampler)}]"
                  f"\tLoss: {loss.item():.6f}")


def evaluate(model, device, loader):
    model.eval()
    stats = torch.zeros(3, device=device)  # loss sum, correct, count
    with torch.no_grad():
        for data, target in loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            stats[0] += F.nll_loss(output, target, reduction="sum")
            stats[1] += (output.argmax(dim=1) == target).sum()
            stats[2] += target.numel()
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    return (stats[0] / stats[2]).item(), (100.0 * stats[1] / stats[2]).item()


def run(rank, world_size):
    setup(rank, world_size)
    torch.manual_seed(CONFIG["seed"])
    device = torch.device("cuda", rank)

    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    if rank == 0:
        datasets.MNIST(CONFIG["data_dir"], train=True, download=True)
        datasets.MNIST(CONFIG["data_dir"], train=False, download=True)
    dist.barrier()
    train_set = datasets.MNIST(CONFIG["data_dir"], train=True, transform=transform)
    test_set = datasets.MNIST(CONFIG["data_dir"], train=False, transform=transform)

    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    test_sampler = DistributedSampler(test_set, num_replicas=world_size, rank=rank, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=CONFIG["batch_size"], sampler=train_sampler,
                              num_workers=2, pin_memory=True)
    test_loader = DataLoader(test_set, batch_size=CONFIG["test_batch_size"], sampler=test_sampler,
                             num_workers=2, pin_memory=True)

    model = Net().to(device)
    model = DDP(model, device_ids=[rank])
    optimizer = optim.Adadelta(model.parameters(), lr=CONFIG["lr"])
    scheduler = StepLR(optimizer, step_size=1, gamma=CONFIG["gamma"])

    for epoch in range(1, CONFIG["epochs"] + 1):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        train_one_epoch(model, device, train_loader, optimizer, epoch, rank)
        test_loss, acc = evaluate(model, device, test_loader)
        scheduler.step()
        if rank == 0:
            print(f"Epoch {epoch}: test loss {test_loss:.4f}, acc {acc:.2f}% ({time.time() - t0:.1f}s)")
            torch.save(model.module.state_dict(), CONFIG["save_path"])

    cleanup()


if __name__ == "__main__":
    world_size = torch.cuda.device_count()
    assert world_size >= 2, f"Requires at least 2 GPUs to run, but got {world_size}"
    mp.spawn(run, args=(world_size), nprocs=world_size, join=True)
