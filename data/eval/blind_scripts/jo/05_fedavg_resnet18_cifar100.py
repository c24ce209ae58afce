"""
FedAvg with ResNet-18 on CIFAR-100 (Dirichlet alpha=0.1), cluster simulation.

Launch (2 nodes x 8 GPUs, Slurm allocates, torchrun inside srun):
    srun --ntasks-per-node=1 torchrun --nnodes=2 --nproc_per_node=8 \
        --rdzv_id=$SLURM_JOB_ID --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        05_fedavg_resnet18_cifar100.py --config configs/c100_a01.yaml
"""
import argparse
import os
import time
from dataclasses import dataclass, asdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import yaml
from torch.utils.data import DataLoader, Subset
from torchvision import transforms


@dataclass
class Cfg:
    data_root: str = "/lustre/datasets/cifar100"
    out_dir: str = "/lustre/exp/fedavg_c100"
    num_clients: int = 200
    sample_rate: float = 0.08
    rounds: int = 1000
    local_epochs: int = 1
    batch_size: int = 64
    lr: float = 0.03
    lr_decay: float = 0.998
    weight_decay: float = 1e-4
    alpha: float = 0.1
    seed: int = 2023
    eval_every: int = 25
    ckpt_every: int = 50


def load_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ns, rest = ap.parse_known_args()
    cfg = Cfg()
    if ns.config:
        with open(ns.config) as f:
            for k, v in (yaml.safe_load(f) or {}).items():
                setattr(cfg, k, v)
    # allow --key value overrides on the command line
    for k, v in zip(rest[::2], rest[1::2]):
        key = k.lstrip("-").replace("-", "_")
        setattr(cfg, key, type(getattr(cfg, key))(v))
    return cfg


def resnet18_cifar(num_classes=100):
    m = torchvision.models.resnet18(num_classes=num_classes)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


def partition(targets, n_clients, alpha, seed):
    rng = np.random.default_rng(seed)
    targets = np.asarray(targets)
    out = [[] for _ in range(n_clients)]
    for c in np.unique(targets):
        ids = rng.permutation(np.flatnonzero(targets == c))
        p = rng.dirichlet([alpha] * n_clients)
        for k, chunk in enumerate(np.split(ids, (np.cumsum(p)[:-1] * len(ids)).astype(int))):
            out[k] += chunk.tolist()
    return out


def run_client(model, loader, cfg, lr, device):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=cfg.weight_decay)
    model.train()
    for _ in range(cfg.local_epochs):
        for x, y in loader:
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()


@torch.no_grad()
def test(model, loader, device):
    model.eval()
    s = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        s[0] += (logits.argmax(-1) == y).sum()
        s[1] += y.numel()
    dist.all_reduce(s)
    return (s[0] / s[1]).item()


def main():
    cfg = load_cfg()
    lrank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(lrank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", lrank)
    torch.manual_seed(cfg.seed + rank)
    torch.backends.cudnn.benchmark = True

    norm = transforms.Normalize((0.507, 0.487, 0.441), (0.267, 0.256, 0.276))
    train_set = torchvision.datasets.CIFAR100(
        cfg.data_root, train=True,
        transform=transforms.Compose([transforms.RandomCrop(32, 4), transforms.RandomHorizontalFlip(),
                                      transforms.ToTensor(), norm]))
    test_set = torchvision.datasets.CIFAR100(
        cfg.data_root, train=False, transform=transforms.Compose([transforms.ToTensor(), norm]))
    parts = partition(train_set.targets, cfg.num_clients, cfg.alpha, cfg.seed)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)),
                             batch_size=500, num_workers=4, pin_memory=True)

    global_model = resnet18_cifar().to(dev).to(memory_format=torch.channels_last)
    client = resnet18_cifar().to(dev).to(memory_format=torch.channels_last)
    with torch.no_grad():
        for t in global_model.state_dict().values():
            dist.broadcast(t, 0)

    start = 0
    last = os.path.join(cfg.out_dir, "last.pt")
    if os.path.isfile(last):
        ck = torch.load(last, map_location=dev)
        global_model.load_state_dict(ck["model"])
        start = ck["round"]
        if rank == 0:
            print(f"resumed from round {start}")

    per_round = max(world, int(cfg.sample_rate * cfg.num_clients))
    for rnd in range(start, cfg.rounds):
        tic = time.time()
        lr = cfg.lr * cfg.lr_decay ** rnd
        sel = np.random.default_rng(cfg.seed + 7919 * rnd).choice(cfg.num_clients, per_round, replace=False)
        mine = sel[rank::world]

        acc = [torch.zeros_like(p, dtype=torch.float32) for p in global_model.parameters()]
        wsum = torch.zeros(1, device=dev)
        for cid in mine:
            if len(parts[cid]) < 2:  # BatchNorm needs at least two samples
                continue
            client.load_state_dict(global_model.state_dict())
            dl = DataLoader(Subset(train_set, parts[cid]), batch_size=cfg.batch_size, shuffle=True,
                            num_workers=4, pin_memory=True, drop_last=len(parts[cid]) > cfg.batch_size)
            run_client(client, dl, cfg, lr, dev)
            n = float(len(parts[cid]))
            for a, p in zip(acc, client.parameters()):
                a.add_(p.detach(), alpha=n)
            wsum += n

        for a in acc:
            dist.all_reduce(a)
        dist.all_reduce(wsum)
        # keep the freshest running statistics from local training, then write the averaged weights
        global_model.load_state_dict(client.state_dict())
        with torch.no_grad():
            for p, a in zip(global_model.parameters(), acc):
                p.copy_(a / wsum)

        if rank == 0 and rnd % 10 == 0:
            print(f"round {rnd} lr {lr:.4f} clients {per_round} time {time.time() - tic:.1f}s", flush=True)

        if (rnd + 1) % cfg.eval_every == 0:
            top1 = test(global_model, test_loader, dev)
            if rank == 0:
                print(f"[eval] round {rnd + 1} top1 {top1:.4f}", flush=True)

        if (rnd + 1) % cfg.ckpt_every == 0 and rank == 0:
            os.makedirs(cfg.out_dir, exist_ok=True)
            tmp = last + ".tmp"
            torch.save({"round": rnd + 1, "model": global_model.state_dict(), "cfg": asdict(cfg)}, tmp)
            os.replace(tmp, last)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
