#!/usr/bin/env python3
# Elastic Weight Consolidation on Permuted MNIST (domain-incremental, 20 tasks).
#
#   torchrun --standalone --nproc_per_node=2 05_ewc_permuted_mnist.py --ewc-lambda 5000
#
# The Fisher diagonal is estimated on each rank's shard and averaged with an
# all-reduce so that every replica applies the same penalty.
import argparse
import logging
import os
from dataclasses import dataclass, asdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import MNIST

logger = logging.getLogger(__name__)


@dataclass
class Config:
    data_dir: str = "/data/mnist"
    out_dir: str = "results/ewc_pmnist"
    num_tasks: int = 20
    epochs: int = 3
    batch_size: int = 128  # global
    lr: float = 0.01
    hidden: int = 400
    ewc_lambda: float = 5000.0
    fisher_samples: int = 1024
    seed: int = 0


def parse_config():
    cfg = Config()
    parser = argparse.ArgumentParser()
    for k, v in asdict(cfg).items():
        parser.add_argument("--" + k.replace("_", "-"), type=type(v), default=v)
    return Config(**vars(parser.parse_args()))


class PermutedMNIST(Dataset):
    def __init__(self, base: MNIST, perm: np.ndarray):
        self.x = (base.data.float().div(255.0).sub(0.1307).div(0.3081)).view(len(base.data), -1)
        self.x = self.x[:, torch.from_numpy(perm)]
        self.y = base.targets.clone()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class MLP(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(784, hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, 10),
        )

    def forward(self, x):
        return self.net(x)


class EWC:
    def __init__(self):
        self.fisher = {}
        self.anchor = {}

    def penalty(self, net):
        if not self.fisher:
            return torch.zeros((), device=next(net.parameters()).device)
        loss = 0.0
        for n, p in net.named_parameters():
            loss = loss + (self.fisher[n] * (p - self.anchor[n]) ** 2).sum()
        return loss

    def consolidate(self, net, loader, n_samples, device):
        """Online EWC: accumulate the empirical Fisher of the task just finished."""
        fisher = {n: torch.zeros_like(p) for n, p in net.named_parameters()}
        net.eval()
        seen = 0
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            for i in range(x.size(0)):
                net.zero_grad()
                out = net(x[i:i + 1])
                F.nll_loss(F.log_softmax(out, 1), y[i:i + 1]).backward()
                for n, p in net.named_parameters():
                    fisher[n] += p.grad.detach() ** 2
            seen += x.size(0)
            if seen >= n_samples:
                break
        count = torch.tensor([float(seen)], device=device)
        dist.all_reduce(count)
        for n in fisher:
            dist.all_reduce(fisher[n])
            fisher[n] /= count
            self.fisher[n] = self.fisher.get(n, 0) + fisher[n]
        self.anchor = {n: p.detach().clone() for n, p in net.named_parameters()}
        net.zero_grad()
        net.train()


@torch.no_grad()
def accuracy(net, ds, device, rank, world):
    idx = torch.arange(rank, len(ds), world)
    x, y = ds.x[idx].to(device), ds.y[idx].to(device)
    correct = (net(x).argmax(1) == y).sum().float()
    stat = torch.stack([correct, torch.tensor(float(len(idx)), device=device)])
    dist.all_reduce(stat)
    return (stat[0] / stat[1]).item()


def main():
    cfg = parse_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="[%(asctime)s] %(message)s")
    torch.manual_seed(cfg.seed)

    train_base = MNIST(cfg.data_dir, train=True, download=False)
    test_base = MNIST(cfg.data_dir, train=False, download=False)
    perms = [np.arange(784)] + [np.random.RandomState(cfg.seed + t).permutation(784)
                                for t in range(1, cfg.num_tasks)]
    test_sets = [PermutedMNIST(test_base, p) for p in perms]

    net = MLP(cfg.hidden).to(device)
    model = DDP(net, device_ids=[local_rank])
    ewc = EWC()
    per_gpu_bs = cfg.batch_size // world
    acc = np.zeros((cfg.num_tasks, cfg.num_tasks))

    for t in range(cfg.num_tasks):
        train_ds = PermutedMNIST(train_base, perms[t])
        sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed)
        loader = DataLoader(train_ds, batch_size=per_gpu_bs, sampler=sampler, num_workers=2, pin_memory=True)
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)

        for epoch in range(cfg.epochs):
            tot, nb = 0.0, 0
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                ce = F.cross_entropy(model(x), y)
                loss = ce + cfg.ewc_lambda / 2 * ewc.penalty(net)
                opt.zero_grad()
                loss.backward()
                opt.step()
                tot += ce.item()
                nb += 1
            logger.info("task %2d epoch %d ce %.4f", t, epoch, tot / nb)

        fisher_loader = DataLoader(train_ds, batch_size=64, sampler=sampler)
        ewc.consolidate(net, fisher_loader, cfg.fisher_samples // world, device)

        for j in range(t + 1):
            acc[t, j] = accuracy(net, test_sets[j], device, rank, world)
        logger.info("after task %2d: mean acc over %d tasks = %.4f", t, t + 1, acc[t, :t + 1].mean())

        if rank == 0:
            os.makedirs(cfg.out_dir, exist_ok=True)
            torch.save({"model": net.state_dict(), "fisher": ewc.fisher, "anchor": ewc.anchor,
                        "task": t}, os.path.join(cfg.out_dir, "ewc_last.pt"))
            np.save(os.path.join(cfg.out_dir, "acc_matrix.npy"), acc)
        dist.barrier()

    logger.info("final average accuracy %.4f", acc[-1].mean())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
