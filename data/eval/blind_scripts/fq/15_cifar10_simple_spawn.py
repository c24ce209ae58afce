"""
Minimal-but-complete DDP example: a small CNN on CIFAR-10 across every GPU on this machine.
Adapted from the PyTorch "Getting Started with DDP" tutorial for a class assignment.

    python 15_cifar10_simple_spawn.py --epochs 40
"""
import argparse
import os
import socket
from datetime import datetime

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
import torchvision
import torchvision.transforms as transforms


def find_free_port():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def setup(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    # avoid clashing with other students' jobs on the shared lab server
    os.environ["MASTER_PORT"] = str(find_free_port())
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)


def cleanup():
    dist.destroy_process_group()


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(64)
        self.conv2 = nn.Conv2d(64, 128, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(128)
        self.conv3 = nn.Conv2d(128, 256, 3, padding=1)
        self.bn3 = nn.BatchNorm2d(256)
        self.pool = nn.MaxPool2d(2, 2)
        self.fc1 = nn.Linear(256 * 4 * 4, 512)
        self.fc2 = nn.Linear(512, 10)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        x = self.pool(F.relu(self.bn1(self.conv1(x))))
        x = self.pool(F.relu(self.bn2(self.conv2(x))))
        x = self.pool(F.relu(self.bn3(self.conv3(x))))
        x = torch.flatten(x, 1)
        x = self.drop(F.relu(self.fc1(x)))
        return self.fc2(x)


def prepare(rank, world_size, batch_size, data_root):
    transform_train = transforms.Compose([
        transforms.RandomCrop(32, padding=4),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)),
    ])
    transform_test = transforms.Compose([
        transforms.ToTensor(),
        transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)),
    ])
    trainset = torchvision.datasets.CIFAR10(root=data_root, train=True, download=False, transform=transform_train)
    testset = torchvision.datasets.CIFAR10(root=data_root, train=False, download=False, transform=transform_test)
    train_sampler = DistributedSampler(trainset, num_replicas=world_size, rank=rank, shuffle=True, drop_last=False)
    test_sampler = DistributedSampler(testset, num_replicas=world_size, rank=rank, shuffle=False)
    trainloader = DataLoader(trainset, batch_size=batch_size, pin_memory=True, num_workers=2,
                             drop_last=False, shuffle=False, sampler=train_sampler)
    testloader = DataLoader(testset, batch_size=batch_size, pin_memory=True, num_workers=2,
                            shuffle=False, sampler=test_sampler)
    return trainloader, testloader, train_sampler


def test(model, loader, rank):
    model.eval()
    t = torch.zeros(2, device=rank)
    with torch.no_grad():
        for images, labels in loader:
            images, labels = images.to(rank), labels.to(rank)
            preds = model(images).argmax(dim=1)
            t[0] += (preds == labels).sum()
            t[1] += labels.size(0)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return (t[0] / t[1]).item()


def main(rank, world_size, args):
    setup(rank, world_size)
    trainloader, testloader, train_sampler = prepare(rank, world_size, args.batch_size, args.data)

    model = SmallCNN().to(rank)
    model = DDP(model, device_ids=[rank], output_device=rank)

    criterion = nn.CrossEntropyLoss()
    optimizer = optim.SGD(model.parameters(), lr=args.lr * world_size, momentum=0.9, weight_decay=5e-4)
    scheduler = optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    writer = SummaryWriter(log_dir=os.path.join("runs", args.run_name)) if rank == 0 else None
    global_step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        running = torch.zeros(2, device=rank)
        for step, (inputs, labels) in enumerate(trainloader):
            inputs, labels = inputs.to(rank), labels.to(rank)
            optimizer.zero_grad(set_to_none=True)
            outputs = model(inputs)
            loss = criterion(outputs, labels)
            loss.backward()
            optimizer.step()
            running[0] += loss.detach()
            running[1] += 1
            global_step += 1
            if writer is not None and step % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), global_step)
        scheduler.step()
        dist.all_reduce(running)

        acc = test(model, testloader, rank)
        if rank == 0:
            print(f"{datetime.now():%H:%M:%S} epoch {epoch + 1}/{args.epochs} "
                  f"loss {(running[0] / running[1]).item():.4f} test acc {acc:.4f}")
            writer.add_scalar("test/acc", acc, epoch)
            torch.save(model.module.state_dict(), os.path.join(args.save_dir, "cifar_cnn.pt"))

    if writer is not None:
        writer.close()
    cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="./data")
    parser.add_argument("--save-dir", default="./saved")
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=128, help="per GPU")
    parser.add_argument("--lr", type=float, default=0.025, help="per GPU, scaled linearly")
    parser.add_argument("--run-name", default=datetime.now().strftime("%Y%m%d-%H%M%S"))
    args = parser.parse_args()

    os.makedirs(args.save_dir, exist_ok=True)
    torchvision.datasets.CIFAR10(root=args.data, train=True, download=True)
    torchvision.datasets.CIFAR10(root=args.data, train=False, download=True)
    world_size = torch.cuda.device_count()
    mp.spawn(main, args=(world_size, args), nprocs=world_size, join=True)
