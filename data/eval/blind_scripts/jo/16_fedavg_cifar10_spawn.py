#!/usr/bin/env python3
# Single-node federated simulation: one worker process per GPU started with mp.spawn,
# YAML config, pathological (2 classes / client) CIFAR-10 split, ResNet-8 with GroupNorm.
#
#   python 16_fedavg_cifar10_spawn.py --config cfg/cifar10_patho.yaml
import argparse
import os
import socket
import time
from contextlib import closing

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.utils.data import DataLoader, Subset
from torchvision import datasets, transforms

DEFAULTS = {
    "data_root": "/data/cifar10",
    "out_dir": "out/cifar10_patho",
    "num_clients": 100,
    "classes_per_client": 2,
    "clients_per_round": 20,
    "rounds": 800,
    "local_epochs": 2,
    "batch_size": 50,
    "lr": 0.05,
    "seed": 0,
    "eval_every": 20,
}


def free_port():
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.n1 = nn.GroupNorm(2, cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.n2 = nn.GroupNorm(2, cout)
        self.short = nn.Sequential()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.GroupNorm(2, cout))

    def forward(self, x):
        out = F.relu(self.n1(self.c1(x)))
        return F.relu(self.n2(self.c2(out)) + self.short(x))


class ResNet8(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.GroupNorm(2, 16), nn.ReLU())
        self.layers = nn.Sequential(BasicBlock(16, 16, 1), BasicBlock(16, 32, 2), BasicBlock(32, 64, 2))
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x):
        return self.fc(F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1).flatten(1))


def pathological_split(targets, num_clients, classes_per_client, seed):
    rng = np.random.default_rng(seed)
    targets = np.asarray(targets)
    n_shards = num_clients * classes_per_client
    order = np.argsort(targets, kind="stable")
    shards = np.array_split(order, n_shards)
    ids = rng.permutation(n_shards).reshape(num_clients, classes_per_client)
    return [np.concatenate([shards[s] for s in row]).tolist() for row in ids]


def local_round(model, loader, epochs, lr, device):
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    for _ in range(epochs):
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    t = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        t[0] += (model(x).argmax(1) == y).sum()
        t[1] += len(y)
    dist.all_reduce(t)
    return (t[0] / t[1]).item()


def train(gpu, cfg, ngpus):
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", init_method=cfg["dist_url"], rank=gpu, world_size=ngpus)
    device = torch.device("cuda", gpu)
    torch.manual_seed(cfg["seed"] + gpu)

    norm = transforms.Normalize((0.4914, 0.4822, 0.4465), (0.247, 0.243, 0.261))
    train_set = datasets.CIFAR10(cfg["data_root"], train=True, transform=transforms.Compose(
        [transforms.RandomCrop(32, 4), transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm]))
    test_set = datasets.CIFAR10(cfg["data_root"], train=False,
                                transform=transforms.Compose([transforms.ToTensor(), norm]))
    splits = pathological_split(train_set.targets, cfg["num_clients"], cfg["classes_per_client"], cfg["seed"])
    test_loader = DataLoader(Subset(test_set, range(gpu, len(test_set), ngpus)), batch_size=500, num_workers=2)

    global_model = ResNet8().to(device)
    client_model = ResNet8().to(device)
    for p in global_model.parameters():
        dist.broadcast(p.data, 0)

    if gpu == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)
    for rnd in range(cfg["rounds"]):
        t0 = time.time()
        rng = np.random.default_rng(cfg["seed"] + 1000 * rnd)
        chosen = rng.choice(cfg["num_clients"], cfg["clients_per_round"], replace=False)
        acc = [torch.zeros_like(p) for p in global_model.parameters()]
        w = torch.zeros(1, device=device)
        for cid in chosen[gpu::ngpus]:
            client_model.load_state_dict(global_model.state_dict())
            loader = DataLoader(Subset(train_set, splits[cid]), batch_size=cfg["batch_size"], shuffle=True,
                                num_workers=2, pin_memory=True)
            local_round(client_model, loader, cfg["local_epochs"], cfg["lr"], device)
            for a, p in zip(acc, client_model.parameters()):
                a.add_(p.detach(), alpha=len(splits[cid]))
            w += len(splits[cid])

        dist.all_reduce(w)
        for a in acc:
            dist.all_reduce(a)
        with torch.no_grad():
            for p, a in zip(global_model.parameters(), acc):
                p.copy_(a / w)

        if (rnd + 1) % cfg["eval_every"] == 0:
            top1 = evaluate(global_model, test_loader, device)
            if gpu == 0:
                print(f"round {rnd + 1}: acc {top1:.4f} ({time.time() - t0:.1f}s/round)", flush=True)
                torch.save({"round": rnd + 1, "model": global_model.state_dict(), "cfg": cfg},
                           os.path.join(cfg["out_dir"], "global.pt"))

    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    cli = ap.parse_args()

    cfg = dict(DEFAULTS)
    if cli.config:
        with open(cli.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    cfg["dist_url"] = f"tcp://127.0.0.1:{free_port()}"

    ngpus = cli.gpus
    assert ngpus >= 1, "needs at least one GPU"
    mp.spawn(train, nprocs=ngpus, args=(ngpus, cfg))


if __name__ == "__main__":
    main()
