"""
MNIST LeNet-5 with DistributedDataParallel.
Saves a checkpoint after every epoch so the run can be resumed with --resume.

    python -m torch.distributed.launch --nproc_per_node=4 --use_env 19_mnist_save_every_epoch.py --epochs 20
    # later:
    python -m torch.distributed.launch --nproc_per_node=4 --use_env 19_mnist_save_every_epoch.py --epochs 30 --resume
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


class LeNet5(nn.Module):
    def __init__(self):
        super(LeNet5, self).__init__()
        self.conv1 = nn.Conv2d(1, 6, 5, padding=2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def get_args():
    parser = argparse.ArgumentParser(description="LeNet-5 MNIST DDP")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--data", type=str, default="./data")
    parser.add_argument("--ckpt-dir", type=str, default="./checkpoints")
    parser.add_argument("--resume", action="store_true")
    return parser.parse_args()


def init_dist():
    # --use_env: the launcher puts everything in environment variables
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    return local_rank, dist.get_rank(), dist.get_world_size()


def evaluate(model, loader, device):
    model.eval()
    correct = torch.zeros(1, device=device)
    seen = torch.zeros(1, device=device)
    loss_sum = torch.zeros(1, device=device)
    with torch.no_grad():
        for data, target in loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            loss_sum += F.cross_entropy(output, target, reduction="sum")
            correct += output.argmax(dim=1).eq(target).sum()
            seen += target.size(0)
    for t in (correct, seen, loss_sum):
        dist.all_reduce(t)
    return (loss_sum / seen).item(), (correct / seen).item()


def main():
    args = get_args()
    local_rank, rank, world_size = init_dist()
    device = torch.device("cuda", local_rank)

    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    if rank == 0:
        datasets.MNIST(args.data, train=True, download=True)
        datasets.MNIST(args.data, train=False, download=True)
        os.makedirs(args.ckpt_dir, exist_ok=True)
    dist.barrier()

    train_set = datasets.MNIST(args.data, train=True, transform=transform)
    test_set = datasets.MNIST(args.data, train=False, transform=transform)
    train_sampler = DistributedSampler(train_set)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=2, pin_memory=True)
    test_loader = DataLoader(test_set, batch_size=1000, sampler=test_sampler, num_workers=2)

    model = LeNet5().to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = optim.SGD(model.parameters(), lr=args.lr * world_size, momentum=args.momentum)
    scheduler = optim.lr_scheduler.StepLR(optimizer, step_size=8, gamma=0.1)

    ckpt_path = os.path.join(args.ckpt_dir, "lenet5_last.pt")
    start_epoch = 0
    if args.resume and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1
        if rank == 0:
            print(f"Resuming from epoch {start_epoch}")

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for batch_idx, (data, target) in enumerate(train_loader):
            data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
            if rank == 0 and batch_idx % 100 == 0:
                print(f"Epoch {epoch} [{batch_idx * len(data)}/{len(train_loader.sampler)}] loss {loss.item():.4f}")
        scheduler.step()

        test_loss, test_acc = evaluate(model, test_loader, device)
        if rank == 0:
            print(f"Epoch {epoch}: test loss {test_loss:.4f}, test acc {100 * test_acc:.2f}% "
                  f"({time.time() - tic:.1f}s)")

        # save a checkpoint so we can resume
        torch.save({
            "epoch": epoch,
            "model": model.module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "test_acc": test_acc,
        }, ckpt_path)

    if rank == 0:
        print("Training finished")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
