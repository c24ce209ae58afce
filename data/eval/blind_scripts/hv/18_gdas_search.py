# GDAS (Gumbel differentiable architecture sampler) search on CIFAR-100,
# NAS-Bench-201 space.  Multi-GPU version of our single-GPU search script.
#
#   torchrun --nproc_per_node=4 18_gdas_search.py --data_path ./data --save_dir ./output/gdas-c100
import argparse
import json
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.datasets as dset
import torchvision.transforms as transforms
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

CANDIDATES = ["none", "skip_connect", "nor_conv_1x1", "nor_conv_3x3", "avg_pool_3x3"]


class ReLUConvBN(nn.Sequential):
    def __init__(self, C_in, C_out, k, stride, pad, affine=True):
        super().__init__(nn.ReLU(inplace=False), nn.Conv2d(C_in, C_out, k, stride, pad, bias=False),
                         nn.BatchNorm2d(C_out, affine=affine))


class Zero(nn.Module):
    def forward(self, x):
        return x.mul(0.0)


def OP(name, C):
    if name == "none":
        return Zero()
    if name == "skip_connect":
        return nn.Identity()
    if name == "nor_conv_1x1":
        return ReLUConvBN(C, C, 1, 1, 0)
    if name == "nor_conv_3x3":
        return ReLUConvBN(C, C, 3, 1, 1)
    return nn.AvgPool2d(3, 1, 1, count_include_pad=False)


class GDASCell(nn.Module):
    def __init__(self, C, max_nodes=4):
        super().__init__()
        self.max_nodes = max_nodes
        self.edges = nn.ModuleDict()
        for i in range(1, max_nodes):
            for j in range(i):
                self.edges["{:}<-{:}".format(i, j)] = nn.ModuleList([OP(n, C) for n in CANDIDATES])
        self.edge_keys = sorted(self.edges.keys())
        self.edge2index = {key: i for i, key in enumerate(self.edge_keys)}

    def forward(self, x, hardwts, index):
        nodes = [x]
        for i in range(1, self.max_nodes):
            inter = []
            for j in range(i):
                key = "{:}<-{:}".format(i, j)
                e = self.edge2index[key]
                k = index[e].item()
                # only the sampled op is run; straight-through weight keeps the gradient to alpha
                inter.append(hardwts[e, k] * self.edges[key][k](nodes[j]))
            nodes.append(sum(inter))
        return nodes[-1]


class ResBlock(nn.Module):
    def __init__(self, C_in, C_out):
        super().__init__()
        self.a = ReLUConvBN(C_in, C_out, 3, 2, 1)
        self.b = ReLUConvBN(C_out, C_out, 3, 1, 1)
        self.down = nn.Sequential(nn.AvgPool2d(2, 2), nn.Conv2d(C_in, C_out, 1, bias=False))

    def forward(self, x):
        return self.b(self.a(x)) + self.down(x)


class GDASNet(nn.Module):
    def __init__(self, C=16, N=5, num_classes=100):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, C, 3, padding=1, bias=False), nn.BatchNorm2d(C))
        cells, c = [], C
        for s in range(3):
            if s:
                cells.append(ResBlock(c, 2 * c))
                c *= 2
            cells += [GDASCell(c) for _ in range(N)]
        self.cells = nn.ModuleList(cells)
        self.lastact = nn.Sequential(nn.BatchNorm2d(c), nn.ReLU(inplace=True))
        self.classifier = nn.Linear(c, num_classes)
        n_edges = len(self.cells[0].edge_keys)
        self.arch_parameters = nn.Parameter(1e-3 * torch.randn(n_edges, len(CANDIDATES)))
        self.tau = 10.0

    def set_tau(self, tau):
        self.tau = tau

    def gumbel_sample(self):
        while True:
            gumbels = -torch.empty_like(self.arch_parameters).exponential_().log()
            logits = (self.arch_parameters.log_softmax(dim=1) + gumbels) / self.tau
            probs = logits.softmax(dim=1)
            index = probs.max(-1, keepdim=True)[1]
            one_h = torch.zeros_like(logits).scatter_(-1, index, 1.0)
            hardwts = one_h - probs.detach() + probs
            if not (torch.isinf(gumbels).any() or torch.isinf(probs).any() or torch.isnan(probs).any()):
                return hardwts, index.squeeze(-1)

    def forward(self, x):
        hardwts, index = self.gumbel_sample()
        x = self.stem(x)
        for cell in self.cells:
            x = cell(x, hardwts, index) if isinstance(cell, GDASCell) else cell(x)
        return self.classifier(F.adaptive_avg_pool2d(self.lastact(x), 1).flatten(1))

    def genotype(self):
        keys = self.cells[0].edge_keys
        best = self.arch_parameters.argmax(-1).tolist()
        return "|" + "|+|".join("|".join("{}~{}".format(CANDIDATES[best[keys.index("{}<-{}".format(i, j))]], j)
                                         for j in range(i)) for i in range(1, 4)) + "|"


def main():
    parser = argparse.ArgumentParser("GDAS")
    parser.add_argument("--data_path", type=str, default="./data")
    parser.add_argument("--save_dir", type=str, default="./output/gdas-c100")
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=250)
    parser.add_argument("--LR", type=float, default=0.025)
    parser.add_argument("--eta_min", type=float, default=0.001)
    parser.add_argument("--decay", type=float, default=5e-4)
    parser.add_argument("--arch_learning_rate", type=float, default=3e-4)
    parser.add_argument("--arch_weight_decay", type=float, default=1e-3)
    parser.add_argument("--tau_max", type=float, default=10)
    parser.add_argument("--tau_min", type=float, default=0.1)
    parser.add_argument("--rand_seed", type=int, default=1)
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()

    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    random.seed(args.rand_seed)
    np.random.seed(args.rand_seed)
    torch.manual_seed(args.rand_seed)

    mean, std = [x / 255 for x in [129.3, 124.1, 112.4]], [x / 255 for x in [68.2, 65.4, 70.4]]
    xform = transforms.Compose([transforms.RandomHorizontalFlip(), transforms.RandomCrop(32, padding=4),
                                transforms.ToTensor(), transforms.Normalize(mean, std)])
    if rank == 0:
        dset.CIFAR100(args.data_path, train=True, download=True)
    dist.barrier()
    train_data = dset.CIFAR100(args.data_path, train=True, transform=xform, download=False)
    half = len(train_data) // 2
    search_train = Subset(train_data, list(range(half)))
    search_valid = Subset(train_data, list(range(half, len(train_data))))
    tr_sampler = DistributedSampler(search_train, shuffle=True)
    va_sampler = DistributedSampler(search_valid, shuffle=True)
    train_loader = DataLoader(search_train, args.batch_size, sampler=tr_sampler, num_workers=4, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(search_valid, args.batch_size, sampler=va_sampler, num_workers=4, pin_memory=True, drop_last=True)

    net = GDASNet().to(device)
    w_params = [p for n, p in net.named_parameters() if n != "arch_parameters"]
    w_optimizer = torch.optim.SGD(w_params, args.LR, momentum=0.9, weight_decay=args.decay, nesterov=True)
    a_optimizer = torch.optim.Adam([net.arch_parameters], lr=args.arch_learning_rate, betas=(0.5, 0.999),
                                   weight_decay=args.arch_weight_decay)
    w_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(w_optimizer, args.epochs, eta_min=args.eta_min)
    # each step runs one sampled op per edge, so most candidate ops get no gradient
    model = DDP(net, device_ids=[args.local_rank], find_unused_parameters=True)
    criterion = nn.CrossEntropyLoss()

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
    genotypes = {}
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        va_sampler.set_epoch(epoch)
        tau = args.tau_max - (args.tau_max - args.tau_min) * epoch / (args.epochs - 1)
        net.set_tau(tau)
        model.train()
        start = time.time()
        meter = torch.zeros(3, device=device)
        for (bx, by), (ax, ay) in zip(train_loader, valid_loader):
            bx, by = bx.to(device, non_blocking=True), by.to(device, non_blocking=True)
            ax, ay = ax.to(device, non_blocking=True), ay.to(device, non_blocking=True)

            w_optimizer.zero_grad()
            loss = criterion(model(bx), by)
            loss.backward()
            nn.utils.clip_grad_norm_(w_params, 5)
            w_optimizer.step()

            a_optimizer.zero_grad()
            a_loss = criterion(model(ax), ay)
            a_loss.backward()
            a_optimizer.step()
            meter += torch.stack([loss.detach(), a_loss.detach(), torch.ones((), device=device)])
        w_scheduler.step()
        dist.all_reduce(meter)

        if rank == 0:
            genotypes[epoch] = net.genotype()
            print("[{:03d}/{:03d}] tau={:.3f} base-loss={:.3f} arch-loss={:.3f} time={:.1f}s {}".format(
                epoch, args.epochs, tau, (meter[0] / meter[2]).item(), (meter[1] / meter[2]).item(),
                time.time() - start, genotypes[epoch]), flush=True)
            torch.save({"epoch": epoch, "net": net.state_dict(), "w_optimizer": w_optimizer.state_dict(),
                        "a_optimizer": a_optimizer.state_dict(), "w_scheduler": w_scheduler.state_dict()},
                       os.path.join(args.save_dir, "checkpoint.pth"))
            with open(os.path.join(args.save_dir, "genotypes.json"), "w") as f:
                json.dump(genotypes, f, indent=1)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
