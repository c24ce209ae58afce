# CSE 599 - Assignment 2, problem 3: multi-GPU ResNet-18 on CIFAR-10 with DDP
# Name: ------   Student ID: ------
#
# Run:  python 04_cifar10_resnet_ddp_assignment.py
# (uses every GPU visible on the node, one process per GPU)
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

DATA_ROOT = "./data"
EPOCHS = 30
BATCH_PER_GPU = 128
BASE_LR = 0.1          # for a global batch of 128, scaled linearly below
MOMENTUM = 0.9
WD = 5e-4
CKPT = "./ckpt/resnet18_cifar10.pt"


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_planes, planes, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride, bias=False),
                nn.BatchNorm2d(planes),
            )

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.in_planes = 64
        self.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.layer1 = self._make_layer(64, 2, 1)
        self.layer2 = self._make_layer(128, 2, 2)
        self.layer3 = self._make_layer(256, 2, 2)
        self.layer4 = self._make_layer(512, 2, 2)
        self.linear = nn.Linear(512, num_classes)

    def _make_layer(self, planes, n, stride):
        layers = []
        for s in [stride] + [1] * (n - 1):
            layers.append(BasicBlock(self.in_planes, planes, s))
            self.in_planes = planes
        return nn.Sequential(*layers)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.linear(out)


def get_datasets(rank):
    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    train_tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(),
                          T.ToTensor(), T.Normalize(mean, std)])
    test_tf = T.Compose([T.ToTensor(), T.Normalize(mean, std)])
    # only rank 0 downloads; the others wait and then read the files it wrote
    if rank == 0:
        torchvision.datasets.CIFAR10(DATA_ROOT, train=True, download=True)
        torchvision.datasets.CIFAR10(DATA_ROOT, train=False, download=True)
    dist.barrier()
    train = torchvision.datasets.CIFAR10(DATA_ROOT, train=True, transform=train_tf)
    test = torchvision.datasets.CIFAR10(DATA_ROOT, train=False, transform=test_tf)
    return train, test


def evaluate(model, loader, device):
    model.eval()
    correct = torch.zeros(1, device=device)
    total = torch.zeros(1, device=device)
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            correct += (model(x).argmax(1) == y).sum()
            total += y.size(0)
    dist.all_reduce(correct)
    dist.all_reduce(total)
    return (correct / total).item()


def run(rank, world_size):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(1234)

    train_set, test_set = get_datasets(rank)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    test_subset = torch.utils.data.Subset(test_set, range(rank, len(test_set), world_size))
    train_loader = DataLoader(train_set, batch_size=BATCH_PER_GPU, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_subset, batch_size=256, num_workers=2)

    model = ResNet18().to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[rank])

    lr = BASE_LR * (BATCH_PER_GPU * world_size) / 128
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM, weight_decay=WD, nesterov=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=EPOCHS)
    writer = SummaryWriter("runs/cifar_ddp") if rank == 0 else None

    for epoch in range(EPOCHS):
        train_sampler.set_epoch(epoch)
        model.train()
        start = time.time()
        loss_sum = torch.zeros(1, device=device)
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach()
        scheduler.step()
        dist.all_reduce(loss_sum)
        train_loss = loss_sum.item() / (len(train_loader) * world_size)
        acc = evaluate(model.module, test_loader, device)
        if rank == 0:
            print(f"Epoch {epoch + 1}/{EPOCHS}  loss {train_loss:.3f}  test acc {acc * 100:.2f}%  "
                  f"time {time.time() - start:.1f}s", flush=True)
            writer.add_scalar("train/loss", train_loss, epoch)
            writer.add_scalar("test/acc", acc, epoch)

    if rank == 0:
        os.makedirs(os.path.dirname(CKPT), exist_ok=True)
        torch.save(model.module.state_dict(), CKPT)
        writer.close()
    dist.destroy_process_group()


n_gpus = torch.cuda.device_count()
print(f"Found {n_gpus} GPUs, launching one process per GPU")
mp.spawn(run, args=(n_gpus,), nprocs=n_gpus, join=True)
