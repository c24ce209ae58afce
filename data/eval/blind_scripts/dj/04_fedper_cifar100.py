"""FedPer: federated training of a shared backbone with personal heads.

Every rank is one client with a Dirichlet(alpha) slice of CIFAR-100. The
backbone is averaged across clients (weighted by local sample count) after
every round; layers listed in --personal stay on the client and are never
communicated. Reported accuracy is the personalised accuracy on each client's
own held-out split, averaged over clients.

torchrun --nnodes=1 --nproc_per_node=8 04_fedper_cifar100.py --config configs/fedper.yaml
"""
import argparse
import os
import time
from dataclasses import dataclass, field, asdict
from typing import List

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
import yaml
from torch.utils.data import DataLoader, Subset
from torch.utils.tensorboard import SummaryWriter


@dataclass
class Config:
    data_root: str = "/datasets/cifar100"
    log_dir: str = "tb/fedper_c100"
    rounds: int = 150
    local_epochs: int = 1
    batch_size: int = 32
    lr: float = 0.01
    momentum: float = 0.9
    alpha: float = 0.3
    holdout: float = 0.2
    seed: int = 2024
    personal: List[str] = field(default_factory=lambda: ["head."])


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--alpha", type=float, default=None)
    a = ap.parse_args()
    cfg = Config()
    if a.config:
        with open(a.config) as f:
            for k, v in (yaml.safe_load(f) or {}).items():
                setattr(cfg, k, v)
    if a.alpha is not None:
        cfg.alpha = a.alpha
    return cfg


def conv_block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                         nn.GroupNorm(4, cout), nn.ReLU(inplace=True))


class Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = nn.Sequential(conv_block(3, 64), conv_block(64, 64), nn.MaxPool2d(2))
        self.layer2 = nn.Sequential(conv_block(64, 128), conv_block(128, 128), nn.MaxPool2d(2))
        self.layer3 = nn.Sequential(conv_block(128, 256), conv_block(256, 256), nn.MaxPool2d(2))
        self.pool = nn.AdaptiveAvgPool2d(1)

    def forward(self, x):
        return torch.flatten(self.pool(self.layer3(self.layer2(self.layer1(x)))), 1)


class FedPerNet(nn.Module):
    def __init__(self, num_classes=100):
        super().__init__()
        self.backbone = Backbone()
        self.head = nn.Sequential(nn.Linear(256, 256), nn.ReLU(inplace=True),
                                  nn.Linear(256, num_classes))

    def forward(self, x):
        return self.head(self.backbone(x))


def split_dirichlet(labels, clients, alpha, seed):
    rng = np.random.default_rng(seed)
    idx_by_client = [[] for _ in range(clients)]
    for c in np.unique(labels):
        idx = rng.permutation(np.nonzero(labels == c)[0])
        share = rng.dirichlet(np.full(clients, alpha))
        cut = (np.cumsum(share)[:-1] * len(idx)).astype(int)
        for k, part in enumerate(np.split(idx, cut)):
            idx_by_client[k].extend(part.tolist())
    return idx_by_client


def shared_keys(model, personal_prefixes):
    keys = set(model.state_dict().keys())
    personal = {k for k in keys if k.startswith(tuple(personal_prefixes))}
    return keys - personal


@torch.no_grad()
def average_shared(model, keys, weight):
    sd = model.state_dict()
    for k in keys:
        t = sd[k]
        if not t.is_floating_point():
            continue
        t.mul_(weight)
        dist.all_reduce(t)


def run_local(model, loader, cfg, device):
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=1e-4)
    model.train()
    losses = []
    for _ in range(cfg.local_epochs):
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return float(np.mean(losses)) if losses else 0.0


@torch.no_grad()
def local_accuracy(model, loader, device):
    model.eval()
    correct = count = 0
    for x, y in loader:
        out = model(x.to(device, non_blocking=True))
        correct += (out.argmax(1).cpu() == y).sum().item()
        count += len(y)
    return correct, count


def main():
    cfg = load_config()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)

    mean, std = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
    train_tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(),
                          T.ToTensor(), T.Normalize(mean, std)])
    eval_tf = T.Compose([T.ToTensor(), T.Normalize(mean, std)])
    base_train = torchvision.datasets.CIFAR100(cfg.data_root, train=True, transform=train_tf)
    base_eval = torchvision.datasets.CIFAR100(cfg.data_root, train=True, transform=eval_tf)

    parts = split_dirichlet(np.array(base_train.targets), world, cfg.alpha, cfg.seed)
    mine = np.random.default_rng(cfg.seed + rank).permutation(parts[rank])
    n_hold = int(len(mine) * cfg.holdout)
    hold_idx, train_idx = mine[:n_hold].tolist(), mine[n_hold:].tolist()

    train_loader = DataLoader(Subset(base_train, train_idx), batch_size=cfg.batch_size,
                              shuffle=True, num_workers=4, pin_memory=True)
    hold_loader = DataLoader(Subset(base_eval, hold_idx), batch_size=256, num_workers=2)

    model = FedPerNet().to(device)
    keys = shared_keys(model, cfg.personal)
    n_shared = sum(model.state_dict()[k].numel() for k in keys)

    n_train = torch.tensor(float(len(train_idx)), device=device)
    n_all = n_train.clone()
    dist.all_reduce(n_all)
    weight = (n_train / n_all).item()

    writer = SummaryWriter(cfg.log_dir) if rank == 0 else None
    if rank == 0:
        print(f"config: {asdict(cfg)}")
        print(f"{world} clients, {n_shared / 1e6:.2f}M shared params, "
              f"{int(n_all.item())} training samples")

    for rnd in range(cfg.rounds):
        t0 = time.time()
        loss = run_local(model, train_loader, cfg, device)
        average_shared(model, keys, weight)

        c, n = local_accuracy(model, hold_loader, device)
        stats = torch.tensor([c, n, loss * len(train_idx)], dtype=torch.float64, device=device)
        dist.all_reduce(stats)
        if rank == 0:
            acc = (stats[0] / stats[1]).item()
            mean_loss = (stats[2] / n_all.double()).item()
            writer.add_scalar("personalized/acc", acc, rnd)
            writer.add_scalar("train/loss", mean_loss, rnd)
            print(f"round {rnd:4d} | loss {mean_loss:.4f} | pers. acc {acc:.4f} | "
                  f"{time.time() - t0:.1f}s", flush=True)

    # personal heads differ per client, so every client keeps its own file
    os.makedirs(os.path.join(cfg.log_dir, "clients"), exist_ok=True)
    torch.save(model.state_dict(), os.path.join(cfg.log_dir, "clients", f"client{rank}.pt"))
    dist.barrier()
    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
