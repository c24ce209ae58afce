#!/usr/bin/env python3
# Task-incremental Split CIFAR-100 (20 tasks x 5 classes) with a shared backbone,
# one linear head per task, and an online-EWC penalty on the shared weights.
#
#   torchrun --nproc_per_node=2 04_ewc_multihead_split_cifar100.py --config configs/ewc_split_c100.yaml
import argparse
import logging
import os
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

log = logging.getLogger(__name__)


@dataclass
class Config:
    data_dir: str = "/data/cifar100"
    out_dir: str = "outputs/ewc_split_c100"
    n_tasks: int = 20
    epochs: int = 20
    batch_size: int = 64
    lr: float = 0.01
    ewc_lambda: float = 5000.0
    ewc_gamma: float = 0.9
    fisher_batches: int = 50
    seed: int = 0
    num_workers: int = 4
    class_order: list = field(default_factory=lambda: list(range(100)))


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ns = ap.parse_args()
    cfg = Config()
    if ns.config:
        with open(ns.config) as f:
            for k, v in (yaml.safe_load(f) or {}).items():
                setattr(cfg, k, v)
    return cfg


def conv_bn(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class MultiHeadNet(nn.Module):
    def __init__(self, n_tasks, classes_per_task):
        super().__init__()
        self.backbone = nn.Sequential(
            conv_bn(3, 64), conv_bn(64, 64), nn.MaxPool2d(2),
            conv_bn(64, 128), conv_bn(128, 128), nn.MaxPool2d(2),
            conv_bn(128, 256), conv_bn(256, 256), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.heads = nn.ModuleList([nn.Linear(256, classes_per_task) for _ in range(n_tasks)])

    def forward(self, x, task_id):
        return self.heads[task_id](self.backbone(x))


class OnlineEWC:
    def __init__(self, module, gamma):
        self.params = {n: p for n, p in module.backbone.named_parameters()}
        self.gamma = gamma
        self.fisher = None
        self.anchor = None

    def penalty(self):
        if self.fisher is None:
            return torch.zeros((), device=next(iter(self.params.values())).device)
        return sum((self.fisher[n] * (p - self.anchor[n]) ** 2).sum() for n, p in self.params.items())

    def consolidate(self, module, loader, task_id, device, n_batches):
        module.eval()
        fisher = {n: torch.zeros_like(p) for n, p in self.params.items()}
        seen = torch.zeros((), device=device)
        for b, (x, y) in enumerate(loader):
            if b >= n_batches:
                break
            x, y = x.to(device), y.to(device)
            module.zero_grad(set_to_none=True)
            loss = F.cross_entropy(module(x, task_id), y, reduction="sum")
            loss.backward()
            for n, p in self.params.items():
                if p.grad is not None:
                    fisher[n] += p.grad.detach() ** 2 / x.size(0)
            seen += 1
        # average over all ranks' batches
        for n in fisher:
            dist.all_reduce(fisher[n])
        dist.all_reduce(seen)
        for n in fisher:
            fisher[n] /= seen.clamp(min=1)
        if self.fisher is None:
            self.fisher = fisher
        else:
            self.fisher = {n: self.gamma * self.fisher[n] + fisher[n] for n in fisher}
        self.anchor = {n: p.detach().clone() for n, p in self.params.items()}
        module.zero_grad(set_to_none=True)
        module.train()


@torch.no_grad()
def task_accuracy(module, dataset, device, task_id, rank, world):
    module.eval()
    idx = list(range(rank, len(dataset), world))
    loader = DataLoader(Subset(dataset, idx), batch_size=500)
    c = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        c[0] += (module(x, task_id).argmax(1) == y).sum()
        c[1] += len(y)
    dist.all_reduce(c)
    module.train()
    return (c[0] / c[1]).item() * 100


def split_by_task(ds, order, n_tasks):
    cpt = len(order) // n_tasks
    targets = np.asarray(ds.targets)
    label_of = {c: i % cpt for i, c in enumerate(order)}
    subsets = []
    for t in range(n_tasks):
        cls = order[t * cpt:(t + 1) * cpt]
        idx = np.flatnonzero(np.isin(targets, cls))
        subsets.append(Subset(ds, idx))
    ds.target_transform = lambda y: label_of[y]
    return subsets, cpt


def main():
    cfg = load_config()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="[%(asctime)s][rank0] %(message)s")
    torch.manual_seed(cfg.seed)

    norm = transforms.Normalize((0.507, 0.487, 0.441), (0.267, 0.256, 0.276))
    train_tf = transforms.Compose([transforms.RandomCrop(32, 4), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), norm])
    test_tf = transforms.Compose([transforms.ToTensor(), norm])
    if rank == 0:
        datasets.CIFAR100(cfg.data_dir, train=True, download=True)
        datasets.CIFAR100(cfg.data_dir, train=False, download=True)
    dist.barrier()
    train_tasks, cpt = split_by_task(datasets.CIFAR100(cfg.data_dir, True, train_tf), cfg.class_order, cfg.n_tasks)
    test_tasks, _ = split_by_task(datasets.CIFAR100(cfg.data_dir, False, test_tf), cfg.class_order, cfg.n_tasks)

    net = MultiHeadNet(cfg.n_tasks, cpt).to(device)
    model = DDP(net, device_ids=[local_rank])
    ewc = OnlineEWC(net, cfg.ewc_gamma)
    R = np.zeros((cfg.n_tasks, cfg.n_tasks))

    for t in range(cfg.n_tasks):
        sampler = DistributedSampler(train_tasks[t], shuffle=True, seed=cfg.seed)
        loader = DataLoader(train_tasks[t], batch_size=cfg.batch_size, sampler=sampler,
                            num_workers=cfg.num_workers, pin_memory=True, drop_last=True)
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
        for ep in range(cfg.epochs):
            sampler.set_epoch(ep)
            tot = torch.zeros(2, device=device)
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                ce = F.cross_entropy(model(x, t), y)
                loss = ce + cfg.ewc_lambda / 2 * ewc.penalty()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                tot[0] += ce.detach() * len(y)
                tot[1] += len(y)
            dist.all_reduce(tot)
            log.info("task %02d epoch %02d  ce %.4f", t, ep, (tot[0] / tot[1]).item())

        ewc.consolidate(net, loader, t, device, cfg.fisher_batches)

        for j in range(t + 1):
            R[t, j] = task_accuracy(net, test_tasks[j], device, j, rank, world)
        bwt = np.mean([R[t, j] - R[j, j] for j in range(t)]) if t else 0.0
        log.info("after task %d: ACC %.2f  BWT %.2f  row %s", t, R[t, :t + 1].mean(), bwt,
                 np.array2string(R[t, :t + 1], precision=1))

        if rank == 0:
            os.makedirs(cfg.out_dir, exist_ok=True)
            torch.save({"model": net.state_dict(), "fisher": ewc.fisher, "anchor": ewc.anchor,
                        "R": R, "task": t}, os.path.join(cfg.out_dir, "last.pt"))
            np.savetxt(os.path.join(cfg.out_dir, "acc_matrix.csv"), R, delimiter=",", fmt="%.2f")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
