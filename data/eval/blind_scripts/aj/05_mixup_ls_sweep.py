"""Mixup / CutMix / label-smoothing sweep for PreAct-ResNet-18 on CIFAR-10.

One sweep point per launch:
    torchrun --nproc_per_node=4 05_mixup_ls_sweep.py --mixup-alpha 0.2 --smoothing 0.1
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as transforms
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


class PreActBlock(nn.Module):
    expansion = 1

    def __init__(self, in_planes, planes, stride=1):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_planes)
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride, bias=False))

    def forward(self, x):
        out = F.relu(self.bn1(x))
        sc = self.shortcut(out) if len(self.shortcut) > 0 else x
        out = self.conv1(out)
        out = self.conv2(F.relu(self.bn2(out)))
        return out + sc


class PreActResNet18(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.in_planes = 64
        self.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        self.layer1 = self._make_layer(64, 2, 1)
        self.layer2 = self._make_layer(128, 2, 2)
        self.layer3 = self._make_layer(256, 2, 2)
        self.layer4 = self._make_layer(512, 2, 2)
        self.bn = nn.BatchNorm2d(512)
        self.linear = nn.Linear(512, num_classes)

    def _make_layer(self, planes, n, stride):
        layers = []
        for s in [stride] + [1] * (n - 1):
            layers.append(PreActBlock(self.in_planes, planes, s))
            self.in_planes = planes
        return nn.Sequential(*layers)

    def forward(self, x):
        out = self.conv1(x)
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        out = F.relu(self.bn(out))
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.linear(out)


def mix_batch(x, y, mixup_alpha, cutmix_alpha, cutmix_prob):
    """Returns mixed inputs, the two targets and the mixing weight."""
    if mixup_alpha <= 0 and cutmix_alpha <= 0:
        return x, y, y, 1.0
    perm = torch.randperm(x.size(0), device=x.device)
    if cutmix_alpha > 0 and np.random.rand() < cutmix_prob:
        lam = np.random.beta(cutmix_alpha, cutmix_alpha)
        H, W = x.shape[2:]
        rh, rw = int(H * np.sqrt(1 - lam)), int(W * np.sqrt(1 - lam))
        cy, cx = np.random.randint(H), np.random.randint(W)
        y1, y2 = np.clip(cy - rh // 2, 0, H), np.clip(cy + rh // 2, 0, H)
        x1, x2 = np.clip(cx - rw // 2, 0, W), np.clip(cx + rw // 2, 0, W)
        x = x.clone()
        x[:, :, y1:y2, x1:x2] = x[perm, :, y1:y2, x1:x2]
        lam = 1 - (y2 - y1) * (x2 - x1) / (H * W)
    else:
        lam = np.random.beta(mixup_alpha, mixup_alpha)
        x = lam * x + (1 - lam) * x[perm]
    return x, y, y[perm], float(lam)


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-dir", default="/data/cifar10")
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=128, help="per GPU")
    parser.add_argument("--lr", type=float, default=0.1, help="per 128 images")
    parser.add_argument("--wd", type=float, default=5e-4)
    parser.add_argument("--mixup-alpha", type=float, default=0.0)
    parser.add_argument("--cutmix-alpha", type=float, default=0.0)
    parser.add_argument("--cutmix-prob", type=float, default=0.5)
    parser.add_argument("--smoothing", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--project", default="cifar-regularization-sweep")
    parser.add_argument("--save-dir", default="sweeps/ckpt")
    return parser.parse_args()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed + rank)

    run_name = f"mix{args.mixup_alpha}_cut{args.cutmix_alpha}_ls{args.smoothing}_s{args.seed}"
    wandb.init(project=args.project, name=run_name, config=vars(args))

    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    train_tf = transforms.Compose([
        transforms.RandomCrop(32, padding=4),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    test_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])
    train_set = torchvision.datasets.CIFAR10(args.data_dir, train=True, transform=train_tf)
    test_set = torchvision.datasets.CIFAR10(args.data_dir, train=False, transform=test_tf)

    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=500, shuffle=False, num_workers=4)

    model = PreActResNet18(num_classes=10).to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.lr * args.batch_size * world_size / 128
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9,
                                weight_decay=args.wd, nesterov=True)
    warmup = 5 * len(train_loader)
    total = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + np.cos(np.pi * (s - warmup) / (total - warmup))),
    )
    criterion = nn.CrossEntropyLoss(label_smoothing=args.smoothing)

    os.makedirs(args.save_dir, exist_ok=True)
    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        meter = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x, ya, yb, lam = mix_batch(x, y, args.mixup_alpha, args.cutmix_alpha, args.cutmix_prob)
            out = model(x)
            loss = lam * criterion(out, ya) + (1 - lam) * criterion(out, yb)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            meter[0] += loss.detach() * x.size(0)
            meter[1] += x.size(0)
        dist.all_reduce(meter)
        train_loss = (meter[0] / meter[1]).item()

        # test set is small: evaluate the full set on rank 0 only
        test_acc = torch.zeros(1, device=device)
        if rank == 0:
            net = model.module
            net.eval()
            correct = 0
            with torch.no_grad():
                for x, y in test_loader:
                    x, y = x.to(device), y.to(device)
                    correct += (net(x).argmax(1) == y).sum().item()
            test_acc[0] = 100.0 * correct / len(test_set)
        dist.broadcast(test_acc, src=0)
        acc = test_acc.item()
        best_acc = max(best_acc, acc)

        wandb.log({"epoch": epoch, "train/loss": train_loss, "test/acc": acc,
                   "test/best_acc": best_acc, "lr": scheduler.get_last_lr()[0],
                   "epoch_time": time.time() - t0})

        if rank == 0 and (epoch + 1) % 20 == 0:
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "args": vars(args)},
                       os.path.join(args.save_dir, f"{run_name}.pt"))

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
