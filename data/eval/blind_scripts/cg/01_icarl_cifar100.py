#!/usr/bin/env python
"""iCaRL on CIFAR-100 (class-incremental, 10 tasks x 10 classes), multi-GPU with DDP.

    torchrun --nproc_per_node=4 01_icarl_cifar100.py --data /datasets/cifar100 --out runs/icarl_b0_10
"""
import argparse
import copy
import json
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms, models

logger = logging.getLogger("icarl")

MEAN, STD = (0.5071, 0.4866, 0.4409), (0.2673, 0.2564, 0.2762)


def parse_args():
    p = argparse.ArgumentParser(description="iCaRL / CIFAR-100")
    p.add_argument("--data", default="./data")
    p.add_argument("--out", default="./runs/icarl")
    p.add_argument("--num-tasks", type=int, default=10)
    p.add_argument("--memory", type=int, default=2000, help="total exemplars")
    p.add_argument("--epochs", type=int, default=70)
    p.add_argument("--batch-size", type=int, default=32, help="per GPU")
    p.add_argument("--lr", type=float, default=2.0)
    p.add_argument("--wd", type=float, default=1e-5)
    p.add_argument("--milestones", type=int, nargs="+", default=[49, 63])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=1993)
    return p.parse_args()


class IncrementalNet(nn.Module):
    def __init__(self):
        super().__init__()
        backbone = models.resnet18(num_classes=10)
        backbone.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        backbone.maxpool = nn.Identity()
        self.feat_dim = backbone.fc.in_features
        backbone.fc = nn.Identity()
        self.backbone = backbone
        self.fc = None

    @property
    def num_classes(self):
        return 0 if self.fc is None else self.fc.out_features

    def expand(self, n_new):
        fc = nn.Linear(self.feat_dim, self.num_classes + n_new)
        if self.fc is not None:
            with torch.no_grad():
                fc.weight[: self.num_classes] = self.fc.weight
                fc.bias[: self.num_classes] = self.fc.bias
        self.fc = fc

    def extract_features(self, x):
        return self.backbone(x)

    def forward(self, x):
        return self.fc(self.backbone(x))


@torch.no_grad()
def extract(model, loader, device):
    feats = []
    for x, _ in loader:
        f = model.extract_features(x.to(device, non_blocking=True))
        feats.append(F.normalize(f, dim=1).cpu())
    return torch.cat(feats)


def herding(feats, m):
    mu = feats.mean(0)
    running = torch.zeros_like(mu)
    chosen = []
    for k in range(1, m + 1):
        d = (mu[None] - (running[None] + feats) / k).norm(dim=1)
        if chosen:
            d[chosen] = float("inf")
        i = int(d.argmin())
        chosen.append(i)
        running += feats[i]
    return chosen


def update_memory(model, eval_train, targets, memory, new_classes, per_class, device, workers):
    for c in memory:
        memory[c] = memory[c][:per_class]
    means = {}
    for c in new_classes:
        idx = np.flatnonzero(targets == c)
        loader = DataLoader(Subset(eval_train, idx), batch_size=256, num_workers=workers)
        feats = extract(model, loader, device)
        sel = herding(feats, per_class)
        memory[c] = idx[sel].tolist()
        means[c] = F.normalize(feats[sel].mean(0), dim=0)
    return memory, means


@torch.no_grad()
def evaluate(net, test_set, test_targets, classes, device):
    net.eval()
    idx = np.flatnonzero(np.isin(test_targets, classes))
    loader = DataLoader(Subset(test_set, idx), batch_size=256, num_workers=4)
    correct = total = 0
    for x, y in loader:
        logits = net(x.to(device))[:, : net.num_classes]
        correct += (logits.argmax(1).cpu() == y).sum().item()
        total += y.numel()
    return 100.0 * correct / max(total, 1)


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    os.makedirs(args.out, exist_ok=True)

    # iCaRL class order (seed 1993), identical on every rank
    order = np.random.RandomState(args.seed).permutation(100)
    remap = np.argsort(order)
    tgt = lambda y: int(remap[y])

    train_tf = transforms.Compose([
        transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    test_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(MEAN, STD)])

    if rank == 0:
        datasets.CIFAR100(args.data, train=True, download=True)
        datasets.CIFAR100(args.data, train=False, download=True)
    dist.barrier()
    train_set = datasets.CIFAR100(args.data, train=True, transform=train_tf, target_transform=tgt)
    eval_train = datasets.CIFAR100(args.data, train=True, transform=test_tf, target_transform=tgt)
    test_set = datasets.CIFAR100(args.data, train=False, transform=test_tf, target_transform=tgt)
    train_targets = remap[np.asarray(train_set.targets)]
    test_targets = remap[np.asarray(test_set.targets)]

    per_task = 100 // args.num_tasks
    net = IncrementalNet()
    old_net = None
    memory = {}
    acc = np.zeros((args.num_tasks, args.num_tasks))

    for t in range(args.num_tasks):
        new_classes = list(range(t * per_task, (t + 1) * per_task))
        n_old = net.num_classes
        net.expand(per_task)
        net.to(device)
        model = DDP(net, device_ids=[local_rank])

        idx = np.flatnonzero(np.isin(train_targets, new_classes)).tolist()
        idx += [i for c in sorted(memory) for i in memory[c]]
        sampler = DistributedSampler(Subset(train_set, idx), shuffle=True, seed=args.seed)
        loader = DataLoader(Subset(train_set, idx), batch_size=args.batch_size, sampler=sampler,
                            num_workers=args.workers, pin_memory=True, drop_last=True)

        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.wd)
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, args.milestones, gamma=0.2)

        for epoch in range(args.epochs):
            model.train()
            sampler.set_epoch(epoch)
            t0, run_loss = time.time(), 0.0
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                logits = model(x)
                onehot = F.one_hot(y, net.num_classes).float()
                if old_net is not None:
                    with torch.no_grad():
                        onehot[:, :n_old] = torch.sigmoid(old_net(x))
                loss = F.binary_cross_entropy_with_logits(logits, onehot)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                run_loss += loss.item()
            sched.step()
            if epoch % 10 == 0 or epoch == args.epochs - 1:
                logger.info("task %d epoch %d loss %.4f (%.1fs)", t, epoch,
                            run_loss / len(loader), time.time() - t0)

        # exemplar management (herding) on rank 0, then shared with the other ranks
        per_class = args.memory // net.num_classes
        model.eval()
        payload = [None]
        if rank == 0:
            memory, _ = update_memory(model, eval_train, train_targets, memory, new_classes,
                                      per_class, device, args.workers)
            payload = [memory]
        dist.broadcast_object_list(payload, src=0)
        memory = payload[0]

        old_net = copy.deepcopy(net).eval()
        for p in old_net.parameters():
            p.requires_grad_(False)

        if rank == 0:
            for j in range(t + 1):
                acc[t, j] = evaluate(net, test_set, test_targets,
                                     list(range(j * per_task, (j + 1) * per_task)), device)
            avg = acc[t, : t + 1].mean()
            fgt = np.mean([acc[:t, j].max() - acc[t, j] for j in range(t)]) if t > 0 else 0.0
            logger.info("task %d  acc %s  avg %.2f  forgetting %.2f", t,
                        np.round(acc[t, : t + 1], 1).tolist(), avg, fgt)
            torch.save({"task": t, "model": net.state_dict(), "memory": memory,
                        "acc": acc}, os.path.join(args.out, f"task_{t}.pt"))
            with open(os.path.join(args.out, "acc_matrix.json"), "w") as f:
                json.dump(acc.tolist(), f)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
