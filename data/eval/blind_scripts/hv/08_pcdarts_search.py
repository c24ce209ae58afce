"""PC-DARTS search (partial channel connections + edge normalisation), distributed.

    torchrun --nproc_per_node=8 08_pcdarts_search.py --dataset cifar100 --batch_size 96
"""
import argparse
import logging
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.datasets as dset
import torchvision.transforms as transforms
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

PRIMITIVES = ["none", "max_pool_3x3", "avg_pool_3x3", "skip_connect", "sep_conv_3x3", "sep_conv_5x5",
              "dil_conv_3x3"]


def channel_shuffle(x, groups):
    b, c, h, w = x.shape
    return x.view(b, groups, c // groups, h, w).transpose(1, 2).contiguous().view(b, c, h, w)


def sep(cin, cout, k, s, p, d=1):
    return nn.Sequential(
        nn.ReLU(inplace=False), nn.Conv2d(cin, cin, k, s, p, dilation=d, groups=cin, bias=False),
        nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout, affine=False))


class FactorizedReduce(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.relu = nn.ReLU(inplace=False)
        self.c1 = nn.Conv2d(cin, cout // 2, 1, 2, bias=False)
        self.c2 = nn.Conv2d(cin, cout // 2, 1, 2, bias=False)
        self.bn = nn.BatchNorm2d(cout, affine=False)

    def forward(self, x):
        x = self.relu(x)
        return self.bn(torch.cat([self.c1(x), self.c2(x[:, :, 1:, 1:])], 1))


def build_op(name, C, stride):
    if name == "none":
        return Zero(stride)
    if name == "max_pool_3x3":
        return nn.Sequential(nn.MaxPool2d(3, stride, 1), nn.BatchNorm2d(C, affine=False))
    if name == "avg_pool_3x3":
        return nn.Sequential(nn.AvgPool2d(3, stride, 1, count_include_pad=False), nn.BatchNorm2d(C, affine=False))
    if name == "skip_connect":
        return nn.Identity() if stride == 1 else FactorizedReduce(C, C)
    if name == "sep_conv_3x3":
        return nn.Sequential(sep(C, C, 3, stride, 1), sep(C, C, 3, 1, 1))
    if name == "sep_conv_5x5":
        return nn.Sequential(sep(C, C, 5, stride, 2), sep(C, C, 5, 1, 2))
    if name == "dil_conv_3x3":
        return sep(C, C, 3, stride, 2, 2)
    raise ValueError(name)


class Zero(nn.Module):
    def __init__(self, stride):
        super().__init__()
        self.stride = stride

    def forward(self, x):
        return x[:, :, ::self.stride, ::self.stride].mul(0.0)


class PartialMixedOp(nn.Module):
    def __init__(self, C, stride, k=4):
        super().__init__()
        self.k, self.stride = k, stride
        self.mp = nn.MaxPool2d(2, 2)
        self.ops = nn.ModuleList(build_op(p, C // k, stride) for p in PRIMITIVES)

    def forward(self, x, weights):
        c = x.size(1) // self.k
        xa, xb = x[:, :c], x[:, c:]
        out = sum(w * op(xa) for w, op in zip(weights, self.ops))
        xb = xb if self.stride == 1 else self.mp(xb)
        return channel_shuffle(torch.cat([out, xb], 1), self.k)


class Cell(nn.Module):
    def __init__(self, steps, c_pp, c_p, C, reduction, reduction_prev):
        super().__init__()
        self.reduction, self.steps = reduction, steps
        self.pre0 = FactorizedReduce(c_pp, C) if reduction_prev else sep(c_pp, C, 1, 1, 0)
        self.pre1 = sep(c_p, C, 1, 1, 0)
        self.ops = nn.ModuleList(PartialMixedOp(C, 2 if reduction and j < 2 else 1)
                                 for i in range(steps) for j in range(2 + i))

    def forward(self, s0, s1, weights, edge_w):
        states, offset = [self.pre0(s0), self.pre1(s1)], 0
        for _ in range(self.steps):
            s = sum(edge_w[offset + j] * self.ops[offset + j](h, weights[offset + j]) for j, h in enumerate(states))
            offset += len(states)
            states.append(s)
        return torch.cat(states[-self.steps:], 1)


class Network(nn.Module):
    def __init__(self, C, num_classes, layers, steps=4, mult=4):
        super().__init__()
        self.steps = steps
        self.stem = nn.Sequential(nn.Conv2d(3, 3 * C, 3, padding=1, bias=False), nn.BatchNorm2d(3 * C))
        c_pp, c_p, cc = 3 * C, 3 * C, C
        self.cells, red_prev = nn.ModuleList(), False
        for i in range(layers):
            red = i in (layers // 3, 2 * layers // 3)
            cc = cc * 2 if red else cc
            self.cells.append(Cell(steps, c_pp, c_p, cc, red, red_prev))
            red_prev, c_pp, c_p = red, c_p, mult * cc
        self.classifier = nn.Linear(c_p, num_classes)
        k, n = sum(2 + i for i in range(steps)), len(PRIMITIVES)
        self.alphas_normal = nn.Parameter(1e-3 * torch.randn(k, n))
        self.alphas_reduce = nn.Parameter(1e-3 * torch.randn(k, n))
        self.betas_normal = nn.Parameter(1e-3 * torch.randn(k))
        self.betas_reduce = nn.Parameter(1e-3 * torch.randn(k))

    def arch_parameters(self):
        return [self.alphas_normal, self.alphas_reduce, self.betas_normal, self.betas_reduce]

    def weight_parameters(self):
        ids = {id(p) for p in self.arch_parameters()}
        return [p for p in self.parameters() if id(p) not in ids]

    def _edge_weights(self, betas):
        out, start = [], 0
        for i in range(self.steps):
            out.append(F.softmax(betas[start:start + 2 + i], dim=-1))
            start += 2 + i
        return torch.cat(out)

    def forward(self, x):
        s0 = s1 = self.stem(x)
        for cell in self.cells:
            a, b = (self.alphas_reduce, self.betas_reduce) if cell.reduction else (self.alphas_normal, self.betas_normal)
            s0, s1 = s1, cell(s0, s1, F.softmax(a, dim=-1), self._edge_weights(b))
        return self.classifier(F.adaptive_avg_pool2d(s1, 1).flatten(1))

    def genotype(self):
        gene = {}
        for kind in ("normal", "reduce"):
            w = F.softmax(getattr(self, f"alphas_{kind}"), -1) * self._edge_weights(getattr(self, f"betas_{kind}"))[:, None]
            w = w.detach().cpu()
            cell, start = [], 0
            for i in range(self.steps):
                block = w[start:start + 2 + i, 1:]  # skip "none"
                top = block.max(1).values.topk(2).indices.tolist()
                cell += [(PRIMITIVES[1 + block[j].argmax().item()], j) for j in top]
                start += 2 + i
            gene[kind] = cell
        return gene


class Architect:
    """First-order architecture step on the validation batch."""

    def __init__(self, model, args):
        self.model = model
        self.optimizer = torch.optim.Adam(model.arch_parameters(), lr=args.arch_learning_rate,
                                          betas=(0.5, 0.999), weight_decay=args.arch_weight_decay)

    def step(self, x_valid, y_valid, criterion):
        self.optimizer.zero_grad()
        loss = criterion(self.model(x_valid), y_valid)
        loss.backward()
        self.optimizer.step()
        return loss.detach()


def main():
    parser = argparse.ArgumentParser("pc-darts")
    parser.add_argument("--data", type=str, default="../data")
    parser.add_argument("--dataset", type=str, default="cifar10", choices=["cifar10", "cifar100"])
    parser.add_argument("--batch_size", type=int, default=256)
    parser.add_argument("--learning_rate", type=float, default=0.1)
    parser.add_argument("--learning_rate_min", type=float, default=0.0)
    parser.add_argument("--weight_decay", type=float, default=3e-4)
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--warmup_epochs", type=int, default=15, help="train weights only")
    parser.add_argument("--init_channels", type=int, default=16)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--arch_learning_rate", type=float, default=6e-4)
    parser.add_argument("--arch_weight_decay", type=float, default=1e-3)
    parser.add_argument("--save", type=str, default="search-pcdarts")
    parser.add_argument("--seed", type=int, default=2)
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    logging.basicConfig(stream=sys.stdout, level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(message)s", datefmt="%m/%d %I:%M:%S %p")

    mean, std = [0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616]
    tf = transforms.Compose([transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(),
                             transforms.ToTensor(), transforms.Normalize(mean, std)])
    DS = dset.CIFAR10 if args.dataset == "cifar10" else dset.CIFAR100
    if rank == 0:
        DS(root=args.data, train=True, download=True)
    dist.barrier()
    train_data = DS(root=args.data, train=True, download=False, transform=tf)
    split = len(train_data) // 2
    train_q, valid_q = Subset(train_data, range(split)), Subset(train_data, range(split, len(train_data)))
    t_sampler, v_sampler = DistributedSampler(train_q), DistributedSampler(valid_q)
    train_queue = DataLoader(train_q, args.batch_size, sampler=t_sampler, pin_memory=True, num_workers=4, drop_last=True)
    valid_queue = DataLoader(valid_q, args.batch_size, sampler=v_sampler, pin_memory=True, num_workers=4, drop_last=True)

    num_classes = 10 if args.dataset == "cifar10" else 100
    net = Network(args.init_channels, num_classes, args.layers).cuda()
    optimizer = torch.optim.SGD(net.weight_parameters(), args.learning_rate, momentum=0.9,
                                weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs, eta_min=args.learning_rate_min)
    model = DDP(net, device_ids=[local_rank])
    architect = Architect(model, args)
    criterion = nn.CrossEntropyLoss().cuda()
    if rank == 0:
        os.makedirs(args.save, exist_ok=True)

    for epoch in range(args.epochs):
        t_sampler.set_epoch(epoch)
        v_sampler.set_epoch(epoch)
        model.train()
        meter = torch.zeros(3, device="cuda")
        tic = time.time()
        for (x, y), (xv, yv) in zip(train_queue, valid_queue):
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            xv, yv = xv.cuda(non_blocking=True), yv.cuda(non_blocking=True)
            if epoch >= args.warmup_epochs:
                architect.step(xv, yv, criterion)
            optimizer.zero_grad()
            logits = model(x)
            loss = criterion(logits, y)
            loss.backward()
            nn.utils.clip_grad_norm_(net.weight_parameters(), 5.0)
            optimizer.step()
            meter += torch.stack([loss.detach() * y.size(0), (logits.argmax(1) == y).sum().float(),
                                  torch.tensor(float(y.size(0)), device="cuda")])
        scheduler.step()
        dist.all_reduce(meter)
        if rank == 0:
            logging.info("epoch %d lr %.4e loss %.4f acc %.4f (%.0fs)", epoch, scheduler.get_last_lr()[0],
                         meter[0] / meter[2], meter[1] / meter[2], time.time() - tic)
            logging.info("genotype = %s", net.genotype())
            torch.save({"epoch": epoch, "model": net.state_dict(), "optimizer": optimizer.state_dict(),
                        "arch_optimizer": architect.optimizer.state_dict()},
                       os.path.join(args.save, "search.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
