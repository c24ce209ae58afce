"""PC-DARTS search (partial channel connections + edge normalisation).

Multi-GPU version of train_search.py. Architecture updates start after
--arch_warmup epochs, as in the paper.

    torchrun --nproc_per_node=8 05_pcdarts_search.py --data /datasets/cifar10 --save exp/pcdarts
"""
import argparse
import glob
import logging
import os
import shutil
import sys
import time

import numpy as np
import torch
import torch.backends.cudnn as cudnn
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.datasets as dset
import torchvision.transforms as transforms
from torch.nn.parallel import DistributedDataParallel

from operations import OPS, FactorizedReduce, ReLUConvBN
from genotypes import PRIMITIVES, Genotype

parser = argparse.ArgumentParser("pcdarts")
parser.add_argument("--data", type=str, default="../data")
parser.add_argument("--batch_size", type=int, default=96)
parser.add_argument("--learning_rate", type=float, default=0.1)
parser.add_argument("--learning_rate_min", type=float, default=0.0)
parser.add_argument("--weight_decay", type=float, default=3e-4)
parser.add_argument("--epochs", type=int, default=50)
parser.add_argument("--arch_warmup", type=int, default=15)
parser.add_argument("--init_channels", type=int, default=16)
parser.add_argument("--layers", type=int, default=8)
parser.add_argument("--k", type=int, default=4, help="partial channel ratio 1/k")
parser.add_argument("--train_portion", type=float, default=0.5)
parser.add_argument("--arch_learning_rate", type=float, default=6e-4)
parser.add_argument("--arch_weight_decay", type=float, default=1e-3)
parser.add_argument("--grad_clip", type=float, default=5)
parser.add_argument("--seed", type=int, default=2)
parser.add_argument("--save", type=str, default="EXP")


def channel_shuffle(x, groups):
    b, c, h, w = x.size()
    x = x.view(b, groups, c // groups, h, w).transpose(1, 2).contiguous()
    return x.view(b, -1, h, w)


class MixedOp(nn.Module):
    def __init__(self, C, stride, k):
        super().__init__()
        self.k = k
        self.mp = nn.MaxPool2d(2, 2)
        self._ops = nn.ModuleList()
        for primitive in PRIMITIVES:
            op = OPS[primitive](C // k, stride, False)
            if "pool" in primitive:
                op = nn.Sequential(op, nn.BatchNorm2d(C // k, affine=False))
            self._ops.append(op)

    def forward(self, x, weights):
        dim = x.shape[1]
        xtemp, xtemp2 = x[:, : dim // self.k], x[:, dim // self.k:]
        temp1 = sum(w * op(xtemp) for w, op in zip(weights, self._ops))
        if temp1.shape[2] == x.shape[2]:
            ans = torch.cat([temp1, xtemp2], dim=1)
        else:
            ans = torch.cat([temp1, self.mp(xtemp2)], dim=1)
        return channel_shuffle(ans, self.k)


class Cell(nn.Module):
    def __init__(self, steps, multiplier, C_pp, C_p, C, reduction, reduction_prev, k):
        super().__init__()
        self.reduction = reduction
        self.pre0 = FactorizedReduce(C_pp, C, affine=False) if reduction_prev else ReLUConvBN(C_pp, C, 1, 1, 0, affine=False)
        self.pre1 = ReLUConvBN(C_p, C, 1, 1, 0, affine=False)
        self._steps, self._multiplier = steps, multiplier
        self._ops = nn.ModuleList()
        for i in range(steps):
            for j in range(2 + i):
                stride = 2 if reduction and j < 2 else 1
                self._ops.append(MixedOp(C, stride, k))

    def forward(self, s0, s1, weights, weights2):
        states = [self.pre0(s0), self.pre1(s1)]
        offset = 0
        for _ in range(self._steps):
            s = sum(weights2[offset + j] * self._ops[offset + j](h, weights[offset + j])
                    for j, h in enumerate(states))
            offset += len(states)
            states.append(s)
        return torch.cat(states[-self._multiplier:], dim=1)


class Network(nn.Module):
    def __init__(self, C, num_classes, layers, k, steps=4, multiplier=4, stem_multiplier=3):
        super().__init__()
        self._steps = steps
        C_curr = stem_multiplier * C
        self.stem = nn.Sequential(nn.Conv2d(3, C_curr, 3, padding=1, bias=False), nn.BatchNorm2d(C_curr))
        C_pp, C_p, C_curr = C_curr, C_curr, C
        self.cells = nn.ModuleList()
        reduction_prev = False
        for i in range(layers):
            reduction = i in [layers // 3, 2 * layers // 3]
            if reduction:
                C_curr *= 2
            cell = Cell(steps, multiplier, C_pp, C_p, C_curr, reduction, reduction_prev, k)
            reduction_prev = reduction
            self.cells.append(cell)
            C_pp, C_p = C_p, multiplier * C_curr
        self.global_pooling = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(C_p, num_classes)

        n_edges = sum(2 + i for i in range(steps))
        n_ops = len(PRIMITIVES)
        self.alphas_normal = nn.Parameter(1e-3 * torch.randn(n_edges, n_ops))
        self.alphas_reduce = nn.Parameter(1e-3 * torch.randn(n_edges, n_ops))
        self.betas_normal = nn.Parameter(1e-3 * torch.randn(n_edges))
        self.betas_reduce = nn.Parameter(1e-3 * torch.randn(n_edges))

    def arch_parameters(self):
        return [self.alphas_normal, self.alphas_reduce, self.betas_normal, self.betas_reduce]

    def weight_parameters(self):
        ids = {id(p) for p in self.arch_parameters()}
        return [p for p in self.parameters() if id(p) not in ids]

    def _edge_weights(self, betas):
        out, start, n = [], 0, 2
        for _ in range(self._steps):
            out.append(F.softmax(betas[start:start + n], dim=-1))
            start += n
            n += 1
        return torch.cat(out)

    def forward(self, x):
        s0 = s1 = self.stem(x)
        for cell in self.cells:
            if cell.reduction:
                w, w2 = F.softmax(self.alphas_reduce, dim=-1), self._edge_weights(self.betas_reduce)
            else:
                w, w2 = F.softmax(self.alphas_normal, dim=-1), self._edge_weights(self.betas_normal)
            s0, s1 = s1, cell(s0, s1, w, w2)
        return self.classifier(self.global_pooling(s1).flatten(1))

    def genotype(self):
        def _parse(weights):
            gene, n, start = [], 2, 0
            for i in range(self._steps):
                W = weights[start:start + n]
                edges = sorted(range(i + 2), key=lambda x: -max(W[x][k] for k in range(len(W[x])) if k != PRIMITIVES.index("none")))[:2]
                for j in edges:
                    k_best = max((k for k in range(len(W[j])) if k != PRIMITIVES.index("none")), key=lambda k: W[j][k])
                    gene.append((PRIMITIVES[k_best], j))
                start += n
                n += 1
            return gene

        wn = (F.softmax(self.alphas_normal, -1) * self._edge_weights(self.betas_normal)[:, None]).detach().cpu().numpy()
        wr = (F.softmax(self.alphas_reduce, -1) * self._edge_weights(self.betas_reduce)[:, None]).detach().cpu().numpy()
        concat = range(2, self._steps + 2)
        return Genotype(normal=_parse(wn), normal_concat=concat, reduce=_parse(wr), reduce_concat=concat)


def main():
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()

    if rank == 0:
        os.makedirs(args.save, exist_ok=True)
        for script in glob.glob("*.py"):
            shutil.copy(script, args.save)
    logging.basicConfig(stream=sys.stdout, level=logging.INFO if rank == 0 else logging.WARN,
                        format="%(asctime)s %(message)s", datefmt="%m/%d %I:%M:%S %p")

    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    cudnn.benchmark = True

    MEAN, STD = [0.49139968, 0.48215827, 0.44653124], [0.24703233, 0.24348505, 0.26158768]
    train_transform = transforms.Compose([
        transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    train_data = dset.CIFAR10(root=args.data, train=True, download=False, transform=train_transform)
    num_train = len(train_data)
    split = int(np.floor(args.train_portion * num_train))
    train_part = torch.utils.data.Subset(train_data, range(split))
    valid_part = torch.utils.data.Subset(train_data, range(split, num_train))

    train_sampler = torch.utils.data.distributed.DistributedSampler(train_part)
    valid_sampler = torch.utils.data.distributed.DistributedSampler(valid_part)
    train_queue = torch.utils.data.DataLoader(train_part, batch_size=args.batch_size, sampler=train_sampler,
                                              pin_memory=True, num_workers=4, drop_last=True)
    valid_queue = torch.utils.data.DataLoader(valid_part, batch_size=args.batch_size, sampler=valid_sampler,
                                              pin_memory=True, num_workers=4, drop_last=True)

    model = Network(args.init_channels, 10, args.layers, args.k).cuda()
    logging.info("param size = %.2fMB", sum(p.numel() for p in model.weight_parameters()) / 1e6)
    model = DistributedDataParallel(model, device_ids=[local_rank], output_device=local_rank)
    criterion = nn.CrossEntropyLoss().cuda()

    # global batch is batch_size * world_size; scale the paper's lr (batch 256) accordingly
    lr = args.learning_rate * args.batch_size * world_size / 256
    optimizer = torch.optim.SGD(model.module.weight_parameters(), lr, momentum=0.9,
                                weight_decay=args.weight_decay)
    arch_optimizer = torch.optim.Adam(model.module.arch_parameters(), lr=args.arch_learning_rate,
                                      betas=(0.5, 0.999), weight_decay=args.arch_weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, float(args.epochs),
                                                           eta_min=args.learning_rate_min)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        logging.info("epoch %d lr %e", epoch, scheduler.get_last_lr()[0])
        logging.info("genotype = %s", model.module.genotype())
        model.train()
        totals = torch.zeros(3, device="cuda")
        start = time.time()
        valid_iter = iter(valid_queue) if epoch >= args.arch_warmup else None
        for step, (inp, target) in enumerate(train_queue):
            inp, target = inp.cuda(non_blocking=True), target.cuda(non_blocking=True)
            if epoch >= args.arch_warmup:
                try:
                    inp_search, target_search = next(valid_iter)
                except StopIteration:
                    valid_iter = iter(valid_queue)
                    inp_search, target_search = next(valid_iter)
                inp_search = inp_search.cuda(non_blocking=True)
                target_search = target_search.cuda(non_blocking=True)
                arch_optimizer.zero_grad()
                criterion(model(inp_search), target_search).backward()
                arch_optimizer.step()

            optimizer.zero_grad()
            logits = model(inp)
            loss = criterion(logits, target)
            loss.backward()
            nn.utils.clip_grad_norm_(model.module.weight_parameters(), args.grad_clip)
            optimizer.step()

            n = inp.size(0)
            totals += torch.stack([loss.detach() * n, (logits.argmax(1) == target).sum().float(),
                                   torch.tensor(float(n), device="cuda")])
            if step % 50 == 0:
                logging.info("train %03d loss %.4f", step, loss.item())
        scheduler.step()

        dist.all_reduce(totals)
        logging.info("train_acc %.2f loss %.4f time %.0fs", 100 * (totals[1] / totals[2]).item(),
                     (totals[0] / totals[2]).item(), time.time() - start)
        if rank == 0:
            torch.save(model.module.state_dict(), os.path.join(args.save, "weights.pt"))
        dist.barrier()

    logging.info("final genotype = %s", model.module.genotype())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
