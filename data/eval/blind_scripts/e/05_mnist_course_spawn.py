# CS-4xx Assignment 3, part 2: data-parallel training of a small CNN on
# Fashion-MNIST with torch.multiprocessing.spawn.
#
# Usage: python 05_mnist_course_spawn.py   (uses every GPU on the node)

import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

# ---------------- hyper-parameters ----------------
DATA_DIR = "./data"
EPOCHS = 12
BATCH_SIZE = 128          # per process
LR = 0.01                 # tuned for 1 GPU; multiplied by the number of GPUs below
MOMENTUM = 0.9
CKPT = "fmnist_cnn.pt"
PORT = "12355"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.conv3 = nn.Conv2d(64, 128, 3, padding=1)
        self.drop = nn.Dropout(0.25)
        self.fc1 = nn.Linear(128 * 3 * 3, 256)
        self.fc2 = nn.Linear(256, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)   # 14x14
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)   # 7x7
        x = F.max_pool2d(F.relu(self.conv3(x)), 2)   # 3x3
        x = self.drop(torch.flatten(x, 1))
        x = F.relu(self.fc1(x))
        return self.fc2(x)


def setup(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = PORT
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)


def cleanup():
    dist.destroy_process_group()


def test(model, device, loader):
    model.eval()
    correct, loss_sum = 0, 0.0
    with torch.no_grad():
        for data, target in loader:
            data, target = data.to(device), target.to(device)
            out = model(data)
            loss_sum += F.cross_entropy(out, target, reduction="sum").item()
            correct += (out.argmax(1) == target).sum().item()
    n = len(loader.dataset)
    return loss_sum / n, correct / n


def train(rank, world_size):
    setup(rank, world_size)
    device = torch.device("cuda", rank)

    tf_train = transforms.Compose([
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize((0.2860,), (0.3530,)),
    ])
    tf_test = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.2860,), (0.3530,))])
    # the data was downloaded by the parent process before spawning
    train_set = datasets.FashionMNIST(DATA_DIR, train=True, download=False, transform=tf_train)
    test_set = datasets.FashionMNIST(DATA_DIR, train=False, download=False, transform=tf_test)

    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=BATCH_SIZE, sampler=sampler, num_workers=2, pin_memory=True)
    test_loader = DataLoader(test_set, batch_size=1000, shuffle=False, num_workers=2)

    model = Net().to(device)
    ddp_model = DDP(model, device_ids=[rank])
    optimizer = optim.SGD(ddp_model.parameters(), lr=LR * world_size, momentum=MOMENTUM)
    scheduler = optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)

    for epoch in range(1, EPOCHS + 1):
        ddp_model.train()
        sampler.set_epoch(epoch)
        start = time.time()
        for batch_idx, (data, target) in enumerate(train_loader):
            data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
            optimizer.zero_grad()
            loss = F.cross_entropy(ddp_model(data), target)
            loss.backward()
            optimizer.step()
            if rank == 0 and batch_idx % 100 == 0:
                print(f"Train Epoch: {epoch} [{batch_idx * len(data) * world_size}/{len(train_set)}]"
                      f"\tLoss: {loss.item():.6f}")
        scheduler.step()

        if rank == 0:
            test_loss, acc = test(ddp_model.module, device, test_loader)
            print(f"Epoch {epoch}: test loss {test_loss:.4f}, accuracy {100 * acc:.2f}% "
                  f"({time.time() - start:.1f}s)")
        dist.barrier()

    if rank == 0:
        torch.save(ddp_model.module.state_dict(), CKPT)
        print("saved", CKPT)
    cleanup()


# download once in the parent so the workers don't all hit the server
datasets.FashionMNIST(DATA_DIR, train=True, download=True)
datasets.FashionMNIST(DATA_DIR, train=False, download=True)

n_gpus = torch.cuda.device_count()
print(f"Spawning {n_gpus} processes")
mp.spawn(train, args=(n_gpus,), nprocs=n_gpus, join=True)
