"""
My first DDP script: MNIST with torch.multiprocessing.spawn

Based on the PyTorch "Getting Started with Distributed Data Parallel" tutorial
and the pytorch/examples mnist script. One process per GPU, all on one machine.

Run:
    python 01_mnist_spawn_basic.py --epochs 10
"""
import os
import argparse
import time

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


def setup(rank, world_size):
    # copied from the tutorial
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"

    # initialize the process group
    dist.init_process_group("nccl", rank=rank, world_size=world_size)


def cleanup():
    dist.destroy_process_group()


class Net(nn.Module):
    # the classic network from pytorch/examples/mnist
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
        output = F.log_softmax(x, dim=1)
        return output


def get_transform():
    return transforms.Compose([
        transforms.ToTensor(),
        transforms.Normalize((0.1307,), (0.3081,))
    ])


def train_one_epoch(model, loader, optimizer, epoch, rank, log_interval):
    model.train()
    for batch_idx, (data, target) in enumerate(loader):
        data, target = data.to(rank), target.to(rank)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        if rank == 0 and batch_idx % log_interval == 0:
            print("Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}".format(
                epoch, batch_idx * len(data), len(loader.sampler),
                100. * batch_idx / len(loader), loss.item()))


def test(model, loader, device):
    # only called on rank 0, on the full test set (no sampler)
    model.eval()
    test_loss = 0
    correct = 0
    with torch.no_grad():
        for data, target in loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            pred = output.argmax(dim=1, keepdim=True)
            correct += pred.eq(target.view_as(pred)).sum().item()

    test_loss /= len(loader.dataset)
    acc = 100. * correct / len(loader.dataset)
    print("\nTest set: Average loss: {:.4f}, Accuracy: {}/{} ({:.2f}%)\n".format(
        test_loss, correct, len(loader.dataset), acc))
    return acc


def main_worker(rank, world_size, args):
    print(f"Running DDP on rank {rank}.")
    setup(rank, world_size)
    torch.cuda.set_device(rank)
    torch.manual_seed(args.seed)

    # --batch-size is the total batch size, it gets split between the GPUs
    per_gpu_batch = args.batch_size // world_size

    # data was already downloaded in main(), so download=False here
    train_dataset = datasets.MNIST(args.data_dir, train=True, download=False,
                                   transform=get_transform())
    test_dataset = datasets.MNIST(args.data_dir, train=False, download=False,
                                  transform=get_transform())

    train_sampler = DistributedSampler(train_dataset, num_replicas=world_size,
                                       rank=rank, shuffle=True)
    train_loader = DataLoader(train_dataset, batch_size=per_gpu_batch,
                              sampler=train_sampler, num_workers=2, pin_memory=True)
    test_loader = DataLoader(test_dataset, batch_size=1000, shuffle=False,
                             num_workers=2, pin_memory=True)

    # create model and move it to GPU with id rank
    model = Net().to(rank)
    ddp_model = DDP(model, device_ids=[rank])

    optimizer = optim.Adadelta(ddp_model.parameters(), lr=args.lr)
    scheduler = optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=args.gamma)

    best_acc = 0.0
    for epoch in range(1, args.epochs + 1):
        start = time.time()
        train_one_epoch(ddp_model, train_loader, optimizer, epoch, rank, args.log_interval)
        scheduler.step()

        if rank == 0:
            print(f"epoch {epoch} took {time.time() - start:.1f}s")
            acc = test(ddp_model.module, test_loader, rank)
            if acc > best_acc:
                best_acc = acc
                torch.save(ddp_model.module.state_dict(), args.save_path)
                print(f"saved new best model ({best_acc:.2f}%) to {args.save_path}")

        # wait for rank 0 to finish testing / saving before the next epoch
        dist.barrier()

    if rank == 0:
        print(f"Done. Best test accuracy: {best_acc:.2f}%")
    cleanup()


def main():
    parser = argparse.ArgumentParser(description="PyTorch MNIST DDP Example")
    parser.add_argument("--batch-size", type=int, default=256,
                        help="total input batch size for training (default: 256)")
    parser.add_argument("--epochs", type=int, default=14,
                        help="number of epochs to train (default: 14)")
    parser.add_argument("--lr", type=float, default=1.0,
                        help="learning rate (default: 1.0)")
    parser.add_argument("--gamma", type=float, default=0.7,
                        help="Learning rate step gamma (default: 0.7)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=20)
    parser.add_argument("--data-dir", type=str, default="./data")
    parser.add_argument("--save-path", type=str, default="mnist_cnn_ddp.pt")
    args = parser.parse_args()

    world_size = torch.cuda.device_count()
    print(f"Found {world_size} GPUs")

    # download once here so the workers don't all download at the same time
    datasets.MNIST(args.data_dir, train=True, download=True)
    datasets.MNIST(args.data_dir, train=False, download=True)

    mp.spawn(main_worker,
             args=(world_size, args),
             nprocs=world_size,
             join=True)


if __name__ == "__main__":
    main()
