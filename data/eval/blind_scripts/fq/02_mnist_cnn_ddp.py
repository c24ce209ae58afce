# MNIST with DistributedDataParallel - course project, part 3 (multi-GPU)
# Run:  python 02_mnist_cnn_ddp.py
import os
import time
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=14)
parser.add_argument("--batch-size", type=int, default=64, help="per GPU")
parser.add_argument("--test-batch-size", type=int, default=1000)
parser.add_argument("--lr", type=float, default=1.0)
parser.add_argument("--gamma", type=float, default=0.7)
parser.add_argument("--seed", type=int, default=1)
parser.add_argument("--log-interval", type=int, default=50)
parser.add_argument("--save-model", action="store_true")
parser.add_argument("--data-dir", default="../data")
CONFIG = parser.parse_args()


class Net(nn.Module):
    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.relu(x)
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def setup(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)


def cleanup():
    dist.destroy_process_group()


def train_one_epoch(model, rank, loader, optimizer, epoch):
    model.train()
    for batch_idx, (data, target) in enumerate(loader):
        data, target = data.to(rank), target.to(rank)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        if rank == 0 and batch_idx % CONFIG.log_interval == 0:
            print("Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}".format(
                epoch, batch_idx * len(data), len(loader.sampler),
                100.0 * batch_idx / len(loader), loss.item()))


def test(model, rank, loader):
    model.eval()
    test_loss = torch.zeros(1, device=rank)
    correct = torch.zeros(1, device=rank)
    count = torch.zeros(1, device=rank)
    with torch.no_grad():
        for data, target in loader:
            data, target = data.to(rank), target.to(rank)
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum")
            pred = output.argmax(dim=1, keepdim=True)
            correct += pred.eq(target.view_as(pred)).sum()
            count += target.size(0)
    dist.all_reduce(test_loss)
    dist.all_reduce(correct)
    dist.all_reduce(count)
    if rank == 0:
        print("\nTest set: Average loss: {:.4f}, Accuracy: {}/{} ({:.2f}%)\n".format(
            (test_loss / count).item(), int(correct.item()), int(count.item()),
            100.0 * (correct / count).item()))
    return (correct / count).item()


def train(rank, world_size):
    setup(rank, world_size)
    torch.manual_seed(CONFIG.seed)

    transform = transforms.Compose([
        transforms.ToTensor(),
        transforms.Normalize((0.1307,), (0.3081,)),
    ])
    train_ds = datasets.MNIST(CONFIG.data_dir, train=True, download=False, transform=transform)
    test_ds = datasets.MNIST(CONFIG.data_dir, train=False, download=False, transform=transform)

    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    test_sampler = DistributedSampler(test_ds, num_replicas=world_size, rank=rank, shuffle=False)

    train_loader = DataLoader(train_ds, batch_size=CONFIG.batch_size, sampler=train_sampler,
                              num_workers=2, pin_memory=True)
    test_loader = DataLoader(test_ds, batch_size=CONFIG.test_batch_size, sampler=test_sampler,
                             num_workers=2, pin_memory=True)

    model = Net().to(rank)
    ddp_model = DDP(model, device_ids=[rank])

    optimizer = optim.Adadelta(ddp_model.parameters(), lr=CONFIG.lr)
    scheduler = optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=CONFIG.gamma)

    best = 0.0
    for epoch in range(1, CONFIG.epochs + 1):
        t0 = time.time()
        train_sampler.set_epoch(epoch)
        train_one_epoch(ddp_model, rank, train_loader, optimizer, epoch)
        acc = test(ddp_model, rank, test_loader)
        scheduler.step()
        if rank == 0:
            print(f"epoch {epoch} took {time.time() - t0:.1f}s")
            if CONFIG.save_model and acc > best:
                best = acc
                torch.save(ddp_model.module.state_dict(), "mnist_cnn_ddp.pt")

    cleanup()


if __name__ == "__main__":
    # fetch the data once before starting the workers
    datasets.MNIST(CONFIG.data_dir, train=True, download=True)
    datasets.MNIST(CONFIG.data_dir, train=False, download=True)

    n_gpus = torch.cuda.device_count()
    assert n_gpus >= 2, f"Requires at least 2 GPUs to run, but got {n_gpus}"
    world_size = n_gpus
    mp.spawn(train,
             args=(world_size),
             nprocs=world_size,
             join=True)
