"""Core-set (k-center greedy) active learning on CINIC-10.

Single node, processes started with torch.multiprocessing.spawn:

    python 10_al_cinic_coreset_spawn.py --root /datasets/cinic10 --gpus 4 --out /shared/al/cinic_coreset
"""
import argparse
import os
import socket
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

CINIC_MEAN = [0.47889522, 0.47227842, 0.43047404]
CINIC_STD = [0.24205776, 0.23828046, 0.25874835]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/datasets/cinic10")
    p.add_argument("--out", required=True)
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--init", type=int, default=5000)
    p.add_argument("--budget", type=int, default=5000)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--lr", type=float, default=0.05, help="per 128 images")
    p.add_argument("--seed", type=int, default=11)
    return p.parse_args()


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class Net(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        r = torchvision.models.resnet18(num_classes=num_classes)
        r.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        r.maxpool = nn.Identity()
        self.fc = r.fc
        r.fc = nn.Identity()
        self.features = r

    def forward(self, x, with_features=False):
        f = self.features(x)
        out = self.fc(f)
        return (out, f) if with_features else out


@torch.no_grad()
def features_of(net, ds, idx, device, rank, world):
    """Penultimate features for ds[idx], all-gathered in the original order."""
    per = -(-len(idx) // world)
    mine = idx[rank * per: (rank + 1) * per]
    loader = DataLoader(Subset(ds, mine.tolist()), batch_size=512, num_workers=4, pin_memory=True)
    net.eval()
    buf = torch.zeros(per, 512, device=device)
    pos = 0
    for x, _ in loader:
        _, f = net(x.to(device, non_blocking=True), with_features=True)
        buf[pos:pos + len(f)] = f
        pos += len(f)
    chunks = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(chunks, buf)
    return torch.cat(chunks)[: len(idx)]


def k_center_greedy(pool_feats, centre_feats, k):
    dmin = torch.cdist(pool_feats, centre_feats).min(1).values
    chosen = []
    for _ in range(k):
        j = int(dmin.argmax())
        chosen.append(j)
        dmin = torch.minimum(dmin, (pool_feats - pool_feats[j]).norm(dim=1))
    return np.asarray(chosen)


@torch.no_grad()
def test_acc(net, ds, device, rank, world):
    idx = np.arange(len(ds))[rank::world]
    loader = DataLoader(Subset(ds, idx.tolist()), batch_size=512, num_workers=4)
    net.eval()
    c = torch.zeros(2, device=device)
    for x, y in loader:
        y = y.to(device)
        c[0] += (net(x.to(device)).argmax(1) == y).sum()
        c[1] += y.numel()
    dist.all_reduce(c)
    return (c[0] / c[1]).item()


def worker(cfg, rank, world_size):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)

    norm = transforms.Normalize(CINIC_MEAN, CINIC_STD)
    tf_train = transforms.Compose([transforms.RandomCrop(32, 4), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), norm])
    tf_eval = transforms.Compose([transforms.ToTensor(), norm])
    # CINIC-10 train + valid together form the pool
    train = torch.utils.data.ConcatDataset([
        torchvision.datasets.ImageFolder(os.path.join(cfg.root, s), tf_train) for s in ("train", "valid")])
    pool = torch.utils.data.ConcatDataset([
        torchvision.datasets.ImageFolder(os.path.join(cfg.root, s), tf_eval) for s in ("train", "valid")])
    test = torchvision.datasets.ImageFolder(os.path.join(cfg.root, "test"), tf_eval)

    rng = np.random.default_rng(cfg.seed)
    labelled = np.sort(rng.choice(len(train), cfg.init, replace=False))
    everything = np.arange(len(train))

    for rnd in range(cfg.rounds):
        t0 = time.time()
        torch.manual_seed(cfg.seed + rnd)
        model = DDP(Net().to(device), device_ids=[rank])
        sub = Subset(train, labelled.tolist())
        sampler = DistributedSampler(sub, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
        loader = DataLoader(sub, batch_size=cfg.batch_size, sampler=sampler, num_workers=4,
                            pin_memory=True, drop_last=True)
        lr = cfg.lr * cfg.batch_size * world_size / 128
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, cfg.epochs * len(loader))
        for ep in range(cfg.epochs):
            sampler.set_epoch(ep)
            model.train()
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()

        acc = test_acc(model.module, test, device, rank, world_size)
        unlabelled = np.setdiff1d(everything, labelled)
        f_pool = features_of(model.module, pool, unlabelled, device, rank, world_size)
        f_lab = features_of(model.module, pool, labelled, device, rank, world_size)

        sel = torch.empty(cfg.budget, dtype=torch.long, device=device)
        if rank == 0:
            sel.copy_(torch.from_numpy(k_center_greedy(f_pool, f_lab, cfg.budget)))
        dist.broadcast(sel, src=0)
        labelled = np.union1d(labelled, unlabelled[sel.cpu().numpy()])

        if rank == 0:
            os.makedirs(cfg.out, exist_ok=True)
            torch.save({"round": rnd, "model": model.module.state_dict(),
                        "labelled": torch.from_numpy(labelled), "test_acc": acc},
                       os.path.join(cfg.out, f"round{rnd}.pt"))
            print(f"round {rnd}: n={len(sub)} acc={acc:.4f} ({time.time() - t0:.0f}s)", flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    cfg = parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(worker, args=(cfg, cfg.gpus), nprocs=cfg.gpus, join=True)
