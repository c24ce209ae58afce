"""Free adversarial training (Shafahi et al. 2019) on CIFAR-10, WRN-32-10, m=8.

    torchrun --nproc_per_node=4 14_free_at_cifar.py --config configs/free_m8.json
"""
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

from models.wide_resnet import WideResNet

CONFIG = {
    "data_dir": "./data",
    "save_dir": "./checkpoints/free_m8",
    "depth": 32,
    "widen": 10,
    "n_repeats": 8,
    "epochs": 205,               # natural epochs; divided by n_repeats
    "batch_size": 128,           # global
    "lr": 0.1,
    "momentum": 0.9,
    "weight_decay": 2e-4,
    "eps": 8.0,
    "fgsm_step": 8.0,
    "eval_every": 2,
    "eval_pgd_steps": 20,
    "workers": 4,
}


def get_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--save-dir", default=None)
    a = ap.parse_args()
    cfg = dict(CONFIG)
    if a.config:
        with open(a.config) as f:
            cfg.update(json.load(f))
    if a.save_dir:
        cfg["save_dir"] = a.save_dir
    return cfg


class Normalize(nn.Module):
    def __init__(self, mean, std):
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(std).view(1, 3, 1, 1))

    def forward(self, x):
        return (x - self.mean) / self.std


def pgd_accuracy(model, loader, eps, steps, device):
    model.eval()
    alpha = 2.0 / 255
    counts = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        delta = torch.zeros_like(x).uniform_(-eps, eps).requires_grad_(True)
        for _ in range(steps):
            loss = F.cross_entropy(model((x + delta).clamp(0, 1)), y)
            g, = torch.autograd.grad(loss, delta)
            delta = (delta.detach() + alpha * g.sign()).clamp(-eps, eps).requires_grad_(True)
        with torch.no_grad():
            counts[0] += (model(x).argmax(1) == y).sum()
            counts[1] += (model((x + delta).clamp(0, 1)).argmax(1) == y).sum()
        counts[2] += y.numel()
    dist.all_reduce(counts)
    return (counts[0] / counts[2]).item(), (counts[1] / counts[2]).item()


def main():
    cfg = get_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    if rank == 0:
        os.makedirs(cfg["save_dir"], exist_ok=True)
        print(json.dumps(cfg, indent=2))

    train_tf = transforms.Compose([transforms.RandomCrop(32, padding=4),
                                   transforms.RandomHorizontalFlip(), transforms.ToTensor()])
    train_set = datasets.CIFAR10(cfg["data_dir"], train=True, transform=train_tf)
    test_set = datasets.CIFAR10(cfg["data_dir"], train=False, transform=transforms.ToTensor())
    per_gpu = cfg["batch_size"] // world
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=per_gpu, sampler=train_sampler,
                              num_workers=cfg["workers"], pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=200, sampler=DistributedSampler(test_set, shuffle=False),
                             num_workers=cfg["workers"], pin_memory=True)

    net = nn.Sequential(Normalize((0.4914, 0.4822, 0.4465), (0.2471, 0.2435, 0.2616)),
                        WideResNet(depth=cfg["depth"], widen_factor=cfg["widen"], num_classes=10))
    model = DDP(net.to(device), device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=cfg["momentum"],
                                weight_decay=cfg["weight_decay"])

    eps = cfg["eps"] / 255.0
    step = cfg["fgsm_step"] / 255.0
    m = cfg["n_repeats"]
    n_epochs = int(math.ceil(cfg["epochs"] / m))
    # lr schedule from the paper, in replay-adjusted epochs
    milestones = [int(n_epochs * 0.5), int(n_epochs * 0.75)]
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=milestones, gamma=0.1)

    noise = torch.zeros(per_gpu, 3, 32, 32, device=device)
    best = 0.0
    for epoch in range(n_epochs):
        model.train()
        t0 = time.time()
        acc = torch.zeros(3, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            for _ in range(m):
                delta = noise[: x.size(0)].clone().requires_grad_(True)
                out = model((x + delta).clamp(0, 1))
                loss = F.cross_entropy(out, y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                noise[: x.size(0)] = (noise[: x.size(0)] + step * delta.grad.sign()).clamp(-eps, eps)
                optimizer.step()
                acc[0] += loss.detach() * y.numel()
                acc[1] += (out.argmax(1) == y).sum()
                acc[2] += y.numel()
        scheduler.step()
        dist.all_reduce(acc)
        if rank == 0:
            print(f"[{epoch + 1}/{n_epochs}] loss {(acc[0] / acc[2]).item():.4f} "
                  f"train-adv acc {(acc[1] / acc[2]).item():.4f} lr {scheduler.get_last_lr()[0]:.4f} "
                  f"{time.time() - t0:.0f}s", flush=True)

        if (epoch + 1) % cfg["eval_every"] == 0 or epoch + 1 == n_epochs:
            clean, robust = pgd_accuracy(model, test_loader, eps, cfg["eval_pgd_steps"], device)
            if rank == 0:
                print(f"    test clean {clean:.4f} PGD-{cfg['eval_pgd_steps']} {robust:.4f}", flush=True)
                torch.save({"epoch": epoch + 1, "model": model.module.state_dict(),
                            "optimizer": optimizer.state_dict(), "clean": clean, "robust": robust},
                           os.path.join(cfg["save_dir"], "last.pt"))
                if robust > best:
                    best = robust
                    torch.save(model.module.state_dict(), os.path.join(cfg["save_dir"], "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
