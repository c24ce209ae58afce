"""Online EWC (Schwarz et al., 2018) on Split CIFAR-100, task-incremental.

Single 100-way output layer; during training and testing the logits are masked
to the classes of the current / queried task (task-IL protocol of GEM/A-GEM).
Backbone is the GEM "reduced ResNet-18" (nf=20).

    torchrun --nproc_per_node=4 09_online_ewc_split_cifar.py --config configs/oewc_cifar100.yaml
"""
import argparse
import os
import time

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

DEVICE = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")

DEFAULTS = dict(data="./data", out="./results/oewc", n_tasks=20, epochs=10, batch_size=128, lr=0.03,
                ewc_lambda=100.0, gamma=0.95, fisher_batches=50, seed=0, workers=4)


# ------------------------------------------------------------------ reduced ResNet-18 (GEM)
class BasicBlock(nn.Module):
    def __init__(self, in_planes, planes, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ReducedResNet18(nn.Module):
    def __init__(self, num_classes=100, nf=20):
        super().__init__()
        self.in_planes = nf
        self.conv1 = nn.Conv2d(3, nf, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(nf)
        self.layer1 = self._make_layer(nf, 1)
        self.layer2 = self._make_layer(nf * 2, 2)
        self.layer3 = self._make_layer(nf * 4, 2)
        self.layer4 = self._make_layer(nf * 8, 2)
        self.linear = nn.Linear(nf * 8, num_classes)

    def _make_layer(self, planes, stride):
        layers = []
        for s in [stride, 1]:
            layers.append(BasicBlock(self.in_planes, planes, s))
            self.in_planes = planes
        return nn.Sequential(*layers)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        return self.linear(F.adaptive_avg_pool2d(out, 1).flatten(1))


# ------------------------------------------------------------------ online EWC
class OnlineEWC:
    def __init__(self, named_params, gamma):
        self.gamma = gamma
        self.fisher = {n: torch.zeros(p.shape, device=DEVICE) for n, p in named_params}
        self.anchor = None

    def consolidate(self, new_fisher, named_params):
        for n, f in new_fisher.items():
            self.fisher[n] = self.gamma * self.fisher[n] + f
        self.anchor = {n: p.detach().clone() for n, p in named_params}

    def penalty(self, named_params):
        if self.anchor is None:
            return 0.0
        return sum((self.fisher[n] * (p - self.anchor[n]) ** 2).sum() for n, p in named_params)


def task_fisher(net, loader, mask, n_batches, device):
    fisher = {n: torch.zeros_like(p) for n, p in net.named_parameters()}
    net.eval()
    seen = 0
    for b, (x, _) in enumerate(loader):
        if b == n_batches:
            break
        x = x.to(device)
        logp = F.log_softmax(net(x) + mask, dim=1)
        y_hat = torch.multinomial(logp.exp(), 1).squeeze(1)
        net.zero_grad(set_to_none=True)
        F.nll_loss(logp, y_hat, reduction="sum").backward()
        for n, p in net.named_parameters():
            if p.grad is not None:
                fisher[n] += p.grad.detach() ** 2
        seen += x.size(0)
    net.zero_grad(set_to_none=True)
    seen = torch.tensor(float(seen), device=device)
    dist.all_reduce(seen)
    for n in fisher:
        dist.all_reduce(fisher[n])
        fisher[n] /= seen
    return fisher


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    for k, v in DEFAULTS.items():
        ap.add_argument(f"--{k}", type=type(v), default=None)
    cli = ap.parse_args()
    cfg = dict(DEFAULTS)
    if cli.config:
        with open(cli.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    cfg.update({k: v for k, v in vars(cli).items() if v is not None and k != "config"})

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(cfg["seed"] + rank)

    tf = transforms.Compose([transforms.ToTensor(),
                             transforms.Normalize((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))])
    train_set = datasets.CIFAR100(cfg["data"], train=True, transform=tf)
    test_set = datasets.CIFAR100(cfg["data"], train=False, transform=tf)
    y_tr, y_te = np.asarray(train_set.targets), np.asarray(test_set.targets)
    cpt = 100 // cfg["n_tasks"]
    tasks = [list(range(t * cpt, (t + 1) * cpt)) for t in range(cfg["n_tasks"])]

    def task_mask(classes):
        m = torch.full((100,), -1e9, device=device)
        m[classes] = 0.0
        return m

    net = ReducedResNet18(100).to(device)
    model = DDP(net, device_ids=[local_rank])
    ewc = OnlineEWC(net.named_parameters(), cfg["gamma"])
    per_gpu = cfg["batch_size"] // world
    acc = np.zeros((cfg["n_tasks"], cfg["n_tasks"]))

    for t, classes in enumerate(tasks):
        mask = task_mask(classes)
        data = Subset(train_set, np.where(np.isin(y_tr, classes))[0].tolist())
        sampler = DistributedSampler(data, shuffle=True, seed=cfg["seed"])
        loader = DataLoader(data, batch_size=per_gpu, sampler=sampler, num_workers=cfg["workers"], pin_memory=True)
        opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
        tic = time.time()
        for epoch in range(cfg["epochs"]):
            sampler.set_epoch(epoch)
            model.train()
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                loss = F.cross_entropy(model(x) + mask, y)
                loss = loss + cfg["ewc_lambda"] * ewc.penalty(net.named_parameters())
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        fisher = task_fisher(net, loader, mask, cfg["fisher_batches"], device)
        ewc.consolidate(fisher, net.named_parameters())

        # task-IL evaluation on every task seen so far, strided test shards + all_reduce
        net.eval()
        hits = torch.zeros(t + 1, 2, device=device)
        with torch.no_grad():
            for j in range(t + 1):
                idx = np.where(np.isin(y_te, tasks[j]))[0][rank::world]
                for x, y in DataLoader(Subset(test_set, idx.tolist()), batch_size=500):
                    x, y = x.to(device), y.to(device)
                    hits[j, 0] += ((net(x) + task_mask(tasks[j])).argmax(1) == y).sum()
                    hits[j, 1] += y.numel()
        dist.all_reduce(hits)
        acc[t, :t + 1] = (100.0 * hits[:, 0] / hits[:, 1]).cpu().numpy()
        if rank == 0:
            print(f"task {t:2d} done in {time.time() - tic:.0f}s | avg acc {acc[t, :t + 1].mean():.2f} | "
                  f"acc on task 0: {acc[t, 0]:.1f}", flush=True)
            os.makedirs(cfg["out"], exist_ok=True)
            torch.save({"model": net.state_dict(), "fisher": ewc.fisher, "anchor": ewc.anchor, "task": t},
                       os.path.join(cfg["out"], "oewc_last.pt"))

    if rank == 0:
        bwt = np.mean([acc[-1, j] - acc[j, j] for j in range(cfg["n_tasks"] - 1)])
        print(f"ACC {acc[-1].mean():.2f}  BWT {bwt:.2f}")
        np.savetxt(os.path.join(cfg["out"], "acc.txt"), acc, fmt="%.2f")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
