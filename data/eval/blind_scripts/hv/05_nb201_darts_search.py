"""DARTS-V1 search in the NAS-Bench-201 cell space (CIFAR-10), multi-GPU.

Usage:
    torchrun --nproc_per_node=4 05_nb201_darts_search.py --config configs/nb201_darts.yaml
"""
import argparse
import json
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

OPS_201 = ["none", "skip_connect", "nor_conv_1x1", "nor_conv_3x3", "avg_pool_3x3"]

DEFAULTS = dict(data_root="./cifar10", out_dir="./exps/nb201-darts", epochs=50, batch_size=64,
                lr=0.025, lr_min=0.001, momentum=0.9, wd=3e-4, arch_lr=3e-4, arch_wd=1e-3,
                C=16, N=5, train_portion=0.5, seed=0, workers=4)


class ReLUConvBN(nn.Module):
    def __init__(self, cin, cout, k, stride, pad):
        super().__init__()
        self.op = nn.Sequential(nn.ReLU(inplace=False), nn.Conv2d(cin, cout, k, stride, pad, bias=False),
                                nn.BatchNorm2d(cout, affine=False, track_running_stats=True))

    def forward(self, x):
        return self.op(x)


class Zero(nn.Module):
    def forward(self, x):
        return x.mul(0.0)


def make_op(name, C):
    return {
        "none": lambda: Zero(),
        "skip_connect": lambda: nn.Identity(),
        "nor_conv_1x1": lambda: ReLUConvBN(C, C, 1, 1, 0),
        "nor_conv_3x3": lambda: ReLUConvBN(C, C, 3, 1, 1),
        "avg_pool_3x3": lambda: nn.AvgPool2d(3, 1, 1, count_include_pad=False),
    }[name]()


class SearchCell(nn.Module):
    """4 nodes, 6 edges, every edge a mixture of OPS_201."""

    def __init__(self, C, max_nodes=4):
        super().__init__()
        self.max_nodes = max_nodes
        self.edges = nn.ModuleDict()
        for i in range(1, max_nodes):
            for j in range(i):
                self.edges[f"{i}<-{j}"] = nn.ModuleList([make_op(o, C) for o in OPS_201])
        self.edge_keys = sorted(self.edges.keys())
        self.edge2index = {k: i for i, k in enumerate(self.edge_keys)}

    def forward(self, x, weights):
        nodes = [x]
        for i in range(1, self.max_nodes):
            acc = 0
            for j in range(i):
                key = f"{i}<-{j}"
                w = weights[self.edge2index[key]]
                acc = acc + sum(wk * op(nodes[j]) for wk, op in zip(w, self.edges[key]))
            nodes.append(acc)
        return nodes[-1]


class ResidualReduce(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.a = ReLUConvBN(cin, cout, 3, 2, 1)
        self.b = ReLUConvBN(cout, cout, 3, 1, 1)
        self.down = nn.Sequential(nn.AvgPool2d(2, 2), nn.Conv2d(cin, cout, 1, bias=False))

    def forward(self, x):
        return self.b(self.a(x)) + self.down(x)


class TinyNetworkDarts(nn.Module):
    def __init__(self, C, N, num_classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, C, 3, padding=1, bias=False), nn.BatchNorm2d(C))
        layers, c = [], C
        for stage in range(3):
            if stage > 0:
                layers.append(ResidualReduce(c, c * 2))
                c *= 2
            layers += [SearchCell(c) for _ in range(N)]
        self.cells = nn.ModuleList(layers)
        self.lastact = nn.Sequential(nn.BatchNorm2d(c), nn.ReLU(inplace=True))
        self.classifier = nn.Linear(c, num_classes)
        num_edges = len(self.cells[0].edge_keys)
        self.arch_parameters = nn.Parameter(1e-3 * torch.randn(num_edges, len(OPS_201)))

    def weight_parameters(self):
        return [p for n, p in self.named_parameters() if n != "arch_parameters"]

    def genotype(self):
        keys = self.cells[0].edge_keys
        best = self.arch_parameters.detach().argmax(-1).tolist()
        nodes = []
        for i in range(1, 4):
            nodes.append("|".join(f"{OPS_201[best[keys.index(f'{i}<-{j}')]]}~{j}" for j in range(i)))
        return "|" + "|+|".join(nodes) + "|"

    def forward(self, x):
        alphas = F.softmax(self.arch_parameters, dim=-1)
        x = self.stem(x)
        for cell in self.cells:
            x = cell(x, alphas) if isinstance(cell, SearchCell) else cell(x)
        x = self.lastact(x)
        return self.classifier(F.adaptive_avg_pool2d(x, 1).flatten(1))


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    cfg = dict(DEFAULTS)
    if args.config:
        with open(args.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    if args.seed is not None:
        cfg["seed"] = args.seed
    return argparse.Namespace(**cfg)


def get_search_loaders(cfg):
    mean, std = [x / 255 for x in [125.3, 123.0, 113.9]], [x / 255 for x in [63.0, 62.1, 66.7]]
    tf = transforms.Compose([transforms.RandomHorizontalFlip(), transforms.RandomCrop(32, padding=4),
                             transforms.ToTensor(), transforms.Normalize(mean, std)])
    train_data = datasets.CIFAR10(cfg.data_root, train=True, transform=tf, download=False)
    num_train = len(train_data)
    indices = np.arange(num_train)
    np.random.shuffle(indices)
    split = int(np.floor(cfg.train_portion * num_train))
    train_part = Subset(train_data, indices[:split].tolist())
    valid_part = Subset(train_data, indices[split:].tolist())

    tr_sampler = DistributedSampler(train_part, shuffle=True, seed=cfg.seed)
    va_sampler = DistributedSampler(valid_part, shuffle=True, seed=cfg.seed)
    kw = dict(batch_size=cfg.batch_size, num_workers=cfg.workers, pin_memory=True, drop_last=True)
    return (DataLoader(train_part, sampler=tr_sampler, **kw), DataLoader(valid_part, sampler=va_sampler, **kw),
            tr_sampler, va_sampler)


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)
    torch.cuda.manual_seed_all(cfg.seed)
    torch.backends.cudnn.benchmark = True

    train_loader, valid_loader, tr_sampler, va_sampler = get_search_loaders(cfg)

    net = TinyNetworkDarts(cfg.C, cfg.N).to(device)
    w_optimizer = torch.optim.SGD(net.weight_parameters(), cfg.lr, momentum=cfg.momentum,
                                  weight_decay=cfg.wd, nesterov=True)
    a_optimizer = torch.optim.Adam([net.arch_parameters], lr=cfg.arch_lr, betas=(0.5, 0.999),
                                   weight_decay=cfg.arch_wd)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(w_optimizer, cfg.epochs, eta_min=cfg.lr_min)
    model = DDP(net, device_ids=[local_rank])
    criterion = nn.CrossEntropyLoss().to(device)

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        history = []

    for epoch in range(cfg.epochs):
        tr_sampler.set_epoch(epoch)
        va_sampler.set_epoch(epoch)
        model.train()
        stats = torch.zeros(4, device=device)
        start = time.time()
        for (base_x, base_y), (arch_x, arch_y) in zip(train_loader, valid_loader):
            base_x, base_y = base_x.to(device, non_blocking=True), base_y.to(device, non_blocking=True)
            arch_x, arch_y = arch_x.to(device, non_blocking=True), arch_y.to(device, non_blocking=True)

            # update the weights
            w_optimizer.zero_grad()
            logits = model(base_x)
            base_loss = criterion(logits, base_y)
            base_loss.backward()
            nn.utils.clip_grad_norm_(net.weight_parameters(), 5)
            w_optimizer.step()

            # update the architecture
            a_optimizer.zero_grad()
            arch_logits = model(arch_x)
            arch_loss = criterion(arch_logits, arch_y)
            arch_loss.backward()
            a_optimizer.step()

            stats[0] += base_loss.detach()
            stats[1] += (logits.argmax(1) == base_y).float().mean()
            stats[2] += arch_loss.detach()
            stats[3] += (arch_logits.argmax(1) == arch_y).float().mean()
        scheduler.step()
        dist.all_reduce(stats)
        stats /= dist.get_world_size() * len(train_loader)

        if rank == 0:
            geno = net.genotype()
            row = dict(epoch=epoch, base_loss=stats[0].item(), base_acc=stats[1].item(),
                       arch_loss=stats[2].item(), arch_acc=stats[3].item(), genotype=geno,
                       secs=round(time.time() - start, 1))
            history.append(row)
            print(json.dumps(row), flush=True)
            torch.save({"epoch": epoch, "state_dict": net.state_dict(), "w_opt": w_optimizer.state_dict(),
                        "a_opt": a_optimizer.state_dict(), "genotype": geno},
                       os.path.join(cfg.out_dir, "checkpoint.pth"))
            with open(os.path.join(cfg.out_dir, "history.json"), "w") as f:
                json.dump(history, f, indent=1)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
