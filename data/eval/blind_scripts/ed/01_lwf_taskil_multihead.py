#!/usr/bin/env python
"""Task-incremental Learning without Forgetting (LwF) on Split CIFAR-100.

Multi-head setting: one linear head per task on top of a shared ResNet-18
backbone. At test time the task identity is given, so accuracy on task j is
computed with head j only.

    torchrun --standalone --nproc_per_node=4 01_lwf_taskil_multihead.py \
        --data /datasets/cifar100 --n_tasks 10 --epochs 60
"""
import argparse
import copy
import json
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

CIFAR_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR_STD = (0.2673, 0.2564, 0.2762)


def parse_args():
    p = argparse.ArgumentParser(description="LwF, task-incremental, multi-head")
    p.add_argument("--data", default="./data")
    p.add_argument("--out", default="./runs/lwf_taskil")
    p.add_argument("--n_tasks", type=int, default=10)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch_size", type=int, default=128, help="global batch size")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--wd", type=float, default=5e-4)
    p.add_argument("--lamb", type=float, default=1.0, help="weight of the LwF term")
    p.add_argument("--T", type=float, default=2.0, help="distillation temperature")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=1993)
    return p.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class TaskSplit(Dataset):
    """Samples of one task, labels shifted to 0..classes_per_task-1."""

    def __init__(self, base, classes):
        targets = np.asarray(base.targets)
        self.base = base
        self.indices = np.where(np.isin(targets, classes))[0]
        self.local = {c: i for i, c in enumerate(classes)}

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        x, y = self.base[int(self.indices[i])]
        return x, self.local[y]


def cifar_resnet18():
    net = torchvision.models.resnet18(num_classes=10)
    net.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    net.maxpool = nn.Identity()
    net.fc = nn.Identity()
    return net


class MultiHeadNet(nn.Module):
    def __init__(self, n_tasks, classes_per_task, feat_dim=512):
        super().__init__()
        self.backbone = cifar_resnet18()
        self.heads = nn.ModuleList(
            [nn.Linear(feat_dim, classes_per_task) for _ in range(n_tasks)]
        )

    def forward(self, x, n_heads):
        feat = self.backbone(x)
        return [self.heads[i](feat) for i in range(n_heads)]


def lwf_loss(new_logits, old_logits, T):
    loss = 0.0
    for n, o in zip(new_logits, old_logits):
        loss = loss + F.kl_div(
            F.log_softmax(n / T, dim=1), F.softmax(o / T, dim=1), reduction="batchmean"
        ) * T * T
    return loss


@torch.no_grad()
def evaluate_task(net, loader, task_id, device):
    net.eval()
    correct, total = 0, 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        out = net(x, task_id + 1)[task_id]
        correct += (out.argmax(1) == y).sum().item()
        total += y.numel()
    return 100.0 * correct / max(total, 1)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    seed_everything(args.seed)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world size {world_size}, args: {vars(args)}", flush=True)

    train_tf = transforms.Compose([
        transforms.RandomCrop(32, padding=4),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(CIFAR_MEAN, CIFAR_STD),
    ])
    test_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(CIFAR_MEAN, CIFAR_STD)])
    train_set = datasets.CIFAR100(args.data, train=True, download=False, transform=train_tf)
    test_set = datasets.CIFAR100(args.data, train=False, download=False, transform=test_tf)

    # fixed class order shared by every rank
    class_order = np.random.RandomState(args.seed).permutation(100).tolist()
    cpt = 100 // args.n_tasks
    tasks = [class_order[t * cpt:(t + 1) * cpt] for t in range(args.n_tasks)]

    net = MultiHeadNet(args.n_tasks, cpt).to(device)
    model = DDP(net, device_ids=[local_rank], output_device=local_rank)
    old_net = None

    per_gpu_bs = args.batch_size // world_size
    acc = np.zeros((args.n_tasks, args.n_tasks))

    for t in range(args.n_tasks):
        train_data = TaskSplit(train_set, tasks[t])
        sampler = DistributedSampler(train_data, shuffle=True, seed=args.seed)
        loader = DataLoader(train_data, batch_size=per_gpu_bs, sampler=sampler,
                            num_workers=args.workers, pin_memory=True, drop_last=True)

        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr,
                                    momentum=args.momentum, weight_decay=args.wd)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            t0 = time.time()
            running = torch.zeros(2, device=device)
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                outputs = model(x, t + 1)
                loss = F.cross_entropy(outputs[t], y)
                if old_net is not None:
                    with torch.no_grad():
                        old_outputs = old_net(x, t)
                    loss = loss + args.lamb * lwf_loss(outputs[:t], old_outputs, args.T)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                running[0] += loss.detach() * y.size(0)
                running[1] += y.size(0)
            scheduler.step()
            dist.all_reduce(running)
            if rank == 0 and (epoch % 10 == 0 or epoch == args.epochs - 1):
                print(f"[task {t}] epoch {epoch:3d} loss {running[0].item() / running[1].item():.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.4f} ({time.time() - t0:.1f}s)", flush=True)

        # evaluation on all tasks seen so far (rank 0, full test set)
        if rank == 0:
            for j in range(t + 1):
                test_loader = DataLoader(TaskSplit(test_set, tasks[j]), batch_size=256,
                                         shuffle=False, num_workers=args.workers)
                acc[t, j] = evaluate_task(net, test_loader, j, device)
            avg = acc[t, :t + 1].mean()
            print(f"after task {t}: " + " ".join(f"{a:5.1f}" for a in acc[t, :t + 1])
                  + f" | avg {avg:.2f}", flush=True)
            torch.save({"task": t, "model": net.state_dict(), "acc": acc},
                       os.path.join(args.out, f"task_{t}.pt"))
        dist.barrier()

        old_net = copy.deepcopy(net).eval()
        for p in old_net.parameters():
            p.requires_grad_(False)

    if rank == 0:
        bwt = np.mean([acc[-1, j] - acc[j, j] for j in range(args.n_tasks - 1)])
        summary = {"acc_matrix": acc.tolist(), "avg_acc": float(acc[-1].mean()), "bwt": float(bwt)}
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print(f"final avg acc {acc[-1].mean():.2f}, BWT {bwt:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
