"""DARTS (first-order) architecture search on CIFAR-10, data parallel.

The architecture parameters live outside the DDP-wrapped network and are fed to
it as forward arguments; their gradients are averaged by hand after the
validation (architecture) step.
"""
import argparse
import logging
import os
import time
from collections import namedtuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

Genotype = namedtuple("Genotype", "normal normal_concat reduce reduce_concat")
PRIMITIVES = ["none", "max_pool_3x3", "avg_pool_3x3", "skip_connect",
              "sep_conv_3x3", "sep_conv_5x5", "dil_conv_3x3", "dil_conv_5x5"]


def conv_bn(cin, cout, k, stride, pad, dil=1, groups=1):
    return [nn.Conv2d(cin, cout, k, stride, pad, dilation=dil, groups=groups, bias=False)]


class ReLUConvBN(nn.Sequential):
    def __init__(self, cin, cout, k, stride, pad):
        super().__init__(nn.ReLU(inplace=False), *conv_bn(cin, cout, k, stride, pad),
                         nn.BatchNorm2d(cout, affine=False))


class DilConv(nn.Sequential):
    def __init__(self, cin, cout, k, stride, pad, dil):
        super().__init__(nn.ReLU(inplace=False), *conv_bn(cin, cin, k, stride, pad, dil, cin),
                         nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout, affine=False))


class SepConv(nn.Sequential):
    def __init__(self, cin, cout, k, stride, pad):
        super().__init__(DilConv(cin, cin, k, stride, pad, 1), DilConv(cin, cout, k, 1, pad, 1))


class Zero(nn.Module):
    def __init__(self, stride):
        super().__init__()
        self.stride = stride

    def forward(self, x):
        return x[:, :, ::self.stride, ::self.stride].mul(0.0)


class FactorizedReduce(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.relu = nn.ReLU(inplace=False)
        self.c1 = nn.Conv2d(cin, cout // 2, 1, 2, bias=False)
        self.c2 = nn.Conv2d(cin, cout // 2, 1, 2, bias=False)
        self.bn = nn.BatchNorm2d(cout, affine=False)

    def forward(self, x):
        x = self.relu(x)
        return self.bn(torch.cat([self.c1(x), self.c2(x[:, :, 1:, 1:])], dim=1))


OPS = {
    "none": lambda C, s: Zero(s),
    "avg_pool_3x3": lambda C, s: nn.AvgPool2d(3, s, 1, count_include_pad=False),
    "max_pool_3x3": lambda C, s: nn.MaxPool2d(3, s, 1),
    "skip_connect": lambda C, s: nn.Identity() if s == 1 else FactorizedReduce(C, C),
    "sep_conv_3x3": lambda C, s: SepConv(C, C, 3, s, 1),
    "sep_conv_5x5": lambda C, s: SepConv(C, C, 5, s, 2),
    "dil_conv_3x3": lambda C, s: DilConv(C, C, 3, s, 2, 2),
    "dil_conv_5x5": lambda C, s: DilConv(C, C, 5, s, 4, 2),
}


class MixedOp(nn.Module):
    def __init__(self, C, stride):
        super().__init__()
        self.ops = nn.ModuleList([OPS[p](C, stride) for p in PRIMITIVES])

    def forward(self, x, weights):
        return sum(w * op(x) for w, op in zip(weights, self.ops))


class Cell(nn.Module):
    def __init__(self, steps, c_pp, c_p, C, reduction, reduction_prev):
        super().__init__()
        self.reduction = reduction
        self.pre0 = FactorizedReduce(c_pp, C) if reduction_prev else ReLUConvBN(c_pp, C, 1, 1, 0)
        self.pre1 = ReLUConvBN(c_p, C, 1, 1, 0)
        self.steps = steps
        self.edges = nn.ModuleList()
        for i in range(steps):
            for j in range(2 + i):
                self.edges.append(MixedOp(C, 2 if reduction and j < 2 else 1))

    def forward(self, s0, s1, weights):
        states = [self.pre0(s0), self.pre1(s1)]
        offset = 0
        for _ in range(self.steps):
            s = sum(self.edges[offset + j](h, weights[offset + j]) for j, h in enumerate(states))
            offset += len(states)
            states.append(s)
        return torch.cat(states[-self.steps:], dim=1)


class SearchNetwork(nn.Module):
    def __init__(self, C=16, num_classes=10, layers=8, steps=4):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 3 * C, 3, padding=1, bias=False), nn.BatchNorm2d(3 * C))
        c_pp, c_p, c_cur = 3 * C, 3 * C, C
        self.cells = nn.ModuleList()
        reduction_prev = False
        for i in range(layers):
            reduction = i in (layers // 3, 2 * layers // 3)
            if reduction:
                c_cur *= 2
            self.cells.append(Cell(steps, c_pp, c_p, c_cur, reduction, reduction_prev))
            reduction_prev = reduction
            c_pp, c_p = c_p, steps * c_cur
        self.classifier = nn.Linear(c_p, num_classes)

    def forward(self, x, alpha_normal, alpha_reduce):
        w_normal = F.softmax(alpha_normal, dim=-1)
        w_reduce = F.softmax(alpha_reduce, dim=-1)
        s0 = s1 = self.stem(x)
        for cell in self.cells:
            s0, s1 = s1, cell(s0, s1, w_reduce if cell.reduction else w_normal)
        return self.classifier(F.adaptive_avg_pool2d(s1, 1).flatten(1))


class Alphas(nn.Module):
    def __init__(self, steps=4):
        super().__init__()
        k = sum(2 + i for i in range(steps))
        self.steps = steps
        self.normal = nn.Parameter(1e-3 * torch.randn(k, len(PRIMITIVES)))
        self.reduce = nn.Parameter(1e-3 * torch.randn(k, len(PRIMITIVES)))

    def genotype(self):
        def parse(weights):
            gene, start = [], 0
            for i in range(self.steps):
                w = weights[start:start + 2 + i]
                none = PRIMITIVES.index("none")
                edges = sorted(range(2 + i), key=lambda j: -max(w[j][k] for k in range(len(w[j])) if k != none))[:2]
                for j in edges:
                    best = max((k for k in range(len(w[j])) if k != none), key=lambda k: w[j][k])
                    gene.append((PRIMITIVES[best], j))
                start += 2 + i
            return gene
        concat = list(range(2, 2 + self.steps))
        return Genotype(parse(F.softmax(self.normal, -1).tolist()), concat,
                        parse(F.softmax(self.reduce, -1).tolist()), concat)


def parse_args():
    p = argparse.ArgumentParser("darts-ddp")
    p.add_argument("--data", default="./data")
    p.add_argument("--save", default="./search-exp")
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--lr", type=float, default=0.025)
    p.add_argument("--lr-min", type=float, default=0.001)
    p.add_argument("--wd", type=float, default=3e-4)
    p.add_argument("--arch-lr", type=float, default=3e-4)
    p.add_argument("--arch-wd", type=float, default=1e-3)
    p.add_argument("--train-portion", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=2)
    return p.parse_args()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(args.seed)
    logging.basicConfig(level=logging.INFO, format=f"[rank{rank}] %(asctime)s %(message)s")
    log = logging.getLogger(__name__)

    tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(),
                    T.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))])
    if rank == 0:
        torchvision.datasets.CIFAR10(args.data, train=True, download=True)
    dist.barrier()
    full = torchvision.datasets.CIFAR10(args.data, train=True, download=False, transform=tf)
    split = int(len(full) * args.train_portion)
    train_set = Subset(full, range(split))
    valid_set = Subset(full, range(split, len(full)))

    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    valid_sampler = DistributedSampler(valid_set, shuffle=True, seed=args.seed + 1)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=4,
                              pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_set, args.batch_size, sampler=valid_sampler, num_workers=4,
                              pin_memory=True, drop_last=True)
    eval_loader = DataLoader(Subset(valid_set, range(rank, len(valid_set), world)), 256,
                             num_workers=4, pin_memory=True)

    net = SearchNetwork().to(device)
    alphas = Alphas().to(device)
    for p in alphas.parameters():
        dist.broadcast(p.data, src=0)
    model = DDP(net, device_ids=[local_rank])

    w_optim = torch.optim.SGD(net.parameters(), args.lr, momentum=0.9, weight_decay=args.wd)
    a_optim = torch.optim.Adam(alphas.parameters(), args.arch_lr, betas=(0.5, 0.999),
                               weight_decay=args.arch_wd)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(w_optim, args.epochs, eta_min=args.lr_min)
    criterion = nn.CrossEntropyLoss()
    if rank == 0:
        os.makedirs(args.save, exist_ok=True)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        valid_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for (x, y), (xv, yv) in zip(train_loader, valid_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            xv, yv = xv.to(device, non_blocking=True), yv.to(device, non_blocking=True)

            # architecture step (first-order approximation)
            a_optim.zero_grad(set_to_none=True)
            arch_loss = criterion(model(xv, alphas.normal, alphas.reduce), yv)
            arch_loss.backward()
            for p in alphas.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(world)
            a_optim.step()

            # weight step
            w_optim.zero_grad(set_to_none=True)
            loss = criterion(model(x, alphas.normal.detach(), alphas.reduce.detach()), y)
            loss.backward()
            nn.utils.clip_grad_norm_(net.parameters(), 5.0)
            w_optim.step()
        sched.step()

        model.eval()
        correct = torch.zeros(2, device=device)
        with torch.no_grad():
            for xv, yv in eval_loader:
                xv, yv = xv.to(device), yv.to(device)
                out = net(xv, alphas.normal, alphas.reduce)
                correct[0] += (out.argmax(1) == yv).sum()
                correct[1] += yv.numel()
        dist.all_reduce(correct)
        acc = (correct[0] / correct[1]).item()

        if rank == 0:
            geno = alphas.genotype()
            log.info("epoch %d valid_acc %.4f time %.1fs genotype %s", epoch, acc, time.time() - t0, geno)
            torch.save({"epoch": epoch, "alphas": alphas.state_dict(), "net": net.state_dict(),
                        "genotype": geno._asdict()}, os.path.join(args.save, "search.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
