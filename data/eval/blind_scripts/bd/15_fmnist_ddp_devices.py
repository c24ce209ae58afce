"""
Fashion-MNIST: VGG-style CNN, DistributedDataParallel, one process per GPU.

Homework 4, task 2 -- convert the single GPU training script from task 1 to DDP.

Launch (1 node, 2 GPUs):
    torchrun --nnodes=1 --nproc_per_node=2 15_fmnist_ddp_devices.py --epochs 12
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


# ---------------------------------------------------------------------------
# model from task 1 (unchanged)
# ---------------------------------------------------------------------------
def conv_bn(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class MiniVGG(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.features = nn.Sequential(
            conv_bn(1, 32), conv_bn(32, 32), nn.MaxPool2d(2),      # 14x14
            conv_bn(32, 64), conv_bn(64, 64), nn.MaxPool2d(2),     # 7x7
            conv_bn(64, 128), nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Dropout(0.3), nn.Linear(128, num_classes))

    def forward(self, x):
        return self.classifier(self.features(x))


# ---------------------------------------------------------------------------
# task 2: distributed helpers
# ---------------------------------------------------------------------------
def init_distributed():
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", world_size=world_size, rank=rank)
    return rank, local_rank, world_size


def all_reduce_sum(values, device):
    t = torch.tensor(values, dtype=torch.float32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def run_epoch(model, loader, criterion, device, optimizer=None):
    training = optimizer is not None
    model.train(training)
    loss_sum, correct, count = 0.0, 0, 0
    with torch.set_grad_enabled(training):
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            out = model(x)
            loss = criterion(out, y)
            if training:
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            loss_sum += loss.item() * y.size(0)
            correct += (out.argmax(1) == y).sum().item()
            count += y.size(0)
    loss_sum, correct, count = all_reduce_sum([loss_sum, correct, count], device)
    return loss_sum / count, correct / count


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="./data")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=128, help="per process")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--out", default="results_task2")
    args = parser.parse_args()

    rank, local_rank, world_size = init_distributed()
    device = torch.device("cuda", local_rank)

    mean, std = (0.2860,), (0.3530,)
    train_tf = transforms.Compose([transforms.RandomCrop(28, padding=2), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), transforms.Normalize(mean, std)])
    test_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])

    if rank == 0:
        datasets.FashionMNIST(args.data, train=True, download=True)
        datasets.FashionMNIST(args.data, train=False, download=True)
        os.makedirs(args.out, exist_ok=True)
    dist.barrier()

    train_set = datasets.FashionMNIST(args.data, train=True, transform=train_tf)
    test_set = datasets.FashionMNIST(args.data, train=False, transform=test_tf)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True)
    test_loader = DataLoader(test_set, batch_size=512, sampler=test_sampler,
                             num_workers=4, pin_memory=True)

    # wrap the task-1 model for DDP and put it on this process' GPU
    model = MiniVGG()
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    model = model.to(device)

    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * world_size, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[6, 9], gamma=0.1)

    history = []
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        tr_loss, tr_acc = run_epoch(model, train_loader, criterion, device, optimizer)
        te_loss, te_acc = run_epoch(model, test_loader, criterion, device)
        scheduler.step()

        if rank == 0:
            dt = time.time() - t0
            print(f"epoch {epoch + 1:2d}/{args.epochs} | train loss {tr_loss:.4f} acc {tr_acc:.4f} | "
                  f"test loss {te_loss:.4f} acc {te_acc:.4f} | {dt:.1f}s")
            history.append({"epoch": epoch + 1, "train_loss": tr_loss, "train_acc": tr_acc,
                            "test_loss": te_loss, "test_acc": te_acc, "time": dt})
            torch.save(model.module.state_dict(), os.path.join(args.out, "minivgg_fmnist.pt"))

    if rank == 0:
        with open(os.path.join(args.out, "history.json"), "w") as f:
            json.dump(history, f, indent=2)
        print("saved history and weights to", args.out)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
