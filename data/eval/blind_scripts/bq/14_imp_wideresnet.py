"""Iterative magnitude pruning of WRN-28-10 on CIFAR-10 with learning-rate rewinding.

Each round: train for --round-epochs, remove --prune-frac of the remaining weights
(global magnitude over all convs except the stem), rewind the LR schedule, repeat.

    torchrun --nproc_per_node=4 14_imp_wideresnet.py --rounds 8 --out runs/imp_wrn
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler


class BasicBlock(nn.Module):
    def __init__(self, c_in, c_out, stride, drop):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(c_in)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.drop = drop
        self.shortcut = None
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Conv2d(c_in, c_out, 1, stride, bias=False)

    def forward(self, x):
        o = F.relu(self.bn1(x))
        y = self.conv1(o)
        y = F.relu(self.bn2(y))
        if self.drop > 0:
            y = F.dropout(y, p=self.drop, training=self.training)
        y = self.conv2(y)
        return y + (self.shortcut(o) if self.shortcut is not None else x)


class WideResNet(nn.Module):
    def __init__(self, depth=28, widen=10, num_classes=10, drop=0.0):
        super().__init__()
        n = (depth - 4) // 6
        w = [16, 16 * widen, 32 * widen, 64 * widen]
        self.conv1 = nn.Conv2d(3, w[0], 3, 1, 1, bias=False)
        layers, c = [], w[0]
        for i, stride in enumerate([1, 2, 2]):
            for j in range(n):
                layers.append(BasicBlock(c, w[i + 1], stride if j == 0 else 1, drop))
                c = w[i + 1]
        self.blocks = nn.Sequential(*layers)
        self.bn = nn.BatchNorm2d(c)
        self.fc = nn.Linear(c, num_classes)

    def forward(self, x):
        x = self.blocks(self.conv1(x))
        x = F.adaptive_avg_pool2d(F.relu(self.bn(x)), 1).flatten(1)
        return self.fc(x)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/cifar10")
    p.add_argument("--out", default="runs/imp_wrn")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--round-epochs", type=int, default=40)
    p.add_argument("--prune-frac", type=float, default=0.2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.1, help="for a global batch of 128")
    p.add_argument("--wd", type=float, default=5e-4)
    return p.parse_args()


def prunable(model):
    return {n: m.weight for n, m in model.named_modules() if isinstance(m, nn.Conv2d) and n != "conv1"}


@torch.no_grad()
def prune_round(weights, masks, frac):
    alive = torch.cat([w[masks[n]].abs() for n, w in weights.items()])
    k = int(frac * alive.numel())
    thr = torch.kthvalue(alive.float().cpu(), k).values.item()
    return {n: masks[n] & (w.abs() > thr) for n, w in weights.items()}


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    tot = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        tot[0] += (model(x).argmax(1) == y).sum()
        tot[1] += y.numel()
    dist.all_reduce(tot)
    return (100.0 * tot[0] / tot[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0
    torch.manual_seed(0)

    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    train_set = torchvision.datasets.CIFAR10(args.data, train=True, transform=T.Compose([
        T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(mean, std)]))
    test_set = torchvision.datasets.CIFAR10(args.data, train=False, transform=T.Compose([
        T.ToTensor(), T.Normalize(mean, std)]))
    sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                              pin_memory=True, drop_last=True)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)), batch_size=500,
                             num_workers=4, pin_memory=True)

    model = WideResNet(28, 10, drop=0.3).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    weights = prunable(model)
    masks = {n: torch.ones_like(w, dtype=torch.bool) for n, w in weights.items()}
    total_prunable = sum(w.numel() for w in weights.values())
    history = []
    if is_main:
        os.makedirs(args.out, exist_ok=True)

    for rnd in range(args.rounds):
        opt = torch.optim.SGD(model.parameters(), lr=args.lr * args.batch_size * world / 128, momentum=0.9,
                              weight_decay=args.wd, nesterov=True)
        sched = torch.optim.lr_scheduler.MultiStepLR(
            opt, milestones=[int(0.5 * args.round_epochs), int(0.75 * args.round_epochs)], gamma=0.2)
        density = sum(m.sum().item() for m in masks.values()) / total_prunable
        if is_main:
            print(f"=== round {rnd}: density {density:.4f}")

        for epoch in range(args.round_epochs):
            sampler.set_epoch(rnd * args.round_epochs + epoch)
            ddp.train()
            t0 = time.time()
            for x, y in train_loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                loss = F.cross_entropy(ddp(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                with torch.no_grad():
                    for n, w in weights.items():
                        w.mul_(masks[n])
            sched.step()
            if is_main and (epoch % 5 == 4 or epoch == args.round_epochs - 1):
                acc = evaluate(ddp, test_loader, device)
                print(f"round {rnd} epoch {epoch}: loss {loss.item():.4f} test acc {acc:.2f} "
                      f"({time.time() - t0:.1f}s/epoch)")

        acc = evaluate(ddp, test_loader, device)
        history.append({"round": rnd, "density": density, "acc": acc})
        if is_main:
            torch.save({"model": model.state_dict(), "masks": {k: v.cpu() for k, v in masks.items()},
                        "round": rnd, "acc": acc}, os.path.join(args.out, f"round{rnd}.pt"))
            with open(os.path.join(args.out, "history.json"), "w") as f:
                json.dump(history, f, indent=1)

        # weights are identical on every rank, so are the new masks
        masks = prune_round(weights, masks, args.prune_frac)
        with torch.no_grad():
            for n, w in weights.items():
                w.mul_(masks[n])

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
