"""GDAS: differentiable architecture sampling with Gumbel-softmax (hard),
multi-GPU. Only the sampled op of every edge is run in the forward pass.

    torchrun --nproc_per_node=4 15_gdas_search.py --data ./data/cifar10 --out exps/gdas-c10
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

from nas_ops import OPS, ReLUConvBN, ResNetBasicblock

SEARCH_SPACE = ["none", "skip_connect", "nor_conv_1x1", "nor_conv_3x3", "avg_pool_3x3"]


class GDASCell(nn.Module):
    def __init__(self, C, max_nodes=4):
        super().__init__()
        self.max_nodes = max_nodes
        self.edges = nn.ModuleDict()
        for i in range(1, max_nodes):
            for j in range(i):
                self.edges[f"{i}<-{j}"] = nn.ModuleList([OPS[o](C, C, 1, False, True) for o in SEARCH_SPACE])
        self.edge_keys = sorted(self.edges.keys())
        self.edge2index = {k: i for i, k in enumerate(self.edge_keys)}

    def forward(self, x, hardwts, index):
        nodes = [x]
        for i in range(1, self.max_nodes):
            inter = []
            for j in range(i):
                e = self.edge2index[f"{i}<-{j}"]
                w, k = hardwts[e], index[e].item()
                # straight-through: only the argmax op runs, the others are scaled by 0 via w
                inter.append(sum(w[k] * op(nodes[j]) if t == k else w[t]
                                 for t, op in enumerate(self.edges[f"{i}<-{j}"])))
            nodes.append(sum(inter))
        return nodes[-1]


class GDASNet(nn.Module):
    def __init__(self, C=16, N=5, num_classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, C, 3, padding=1, bias=False), nn.BatchNorm2d(C))
        self.cells = nn.ModuleList()
        cin = C
        for stage, c in enumerate([C, 2 * C, 4 * C]):
            if stage:
                self.cells.append(ResNetBasicblock(cin, c, 2))
            for _ in range(N):
                self.cells.append(GDASCell(c))
            cin = c
        self.lastact = nn.Sequential(nn.BatchNorm2d(cin), nn.ReLU(inplace=True))
        self.classifier = nn.Linear(cin, num_classes)
        n_edges = len(self.cells[-1].edge_keys)
        self.arch_parameters = nn.Parameter(1e-3 * torch.randn(n_edges, len(SEARCH_SPACE)))
        self.tau = 10.0

    def sample_hardwts(self):
        while True:
            gumbels = -torch.empty_like(self.arch_parameters).exponential_().log()
            logits = (self.arch_parameters.log_softmax(dim=1) + gumbels) / self.tau
            probs = F.softmax(logits, dim=1)
            index = probs.max(-1, keepdim=True)[1]
            one_h = torch.zeros_like(logits).scatter_(-1, index, 1.0)
            hardwts = one_h - probs.detach() + probs
            if not (torch.isinf(gumbels).any() or torch.isinf(probs).any() or torch.isnan(probs).any()):
                return hardwts, index

    def forward(self, x):
        hardwts, index = self.sample_hardwts()
        s = self.stem(x)
        for cell in self.cells:
            s = cell(s, hardwts, index) if isinstance(cell, GDASCell) else cell(s)
        s = self.lastact(s)
        return self.classifier(F.adaptive_avg_pool2d(s, 1).flatten(1))

    def genotype(self):
        best = self.arch_parameters.argmax(-1).tolist()
        return "|".join(f"{SEARCH_SPACE[b]}~{k}" for k, b in zip(self.cells[-1].edge_keys, best))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="./data/cifar10")
    ap.add_argument("--out", default="exps/gdas-c10")
    ap.add_argument("--epochs", type=int, default=250)
    ap.add_argument("--batch-size", type=int, default=64, help="per GPU")
    ap.add_argument("--lr", type=float, default=0.025, help="per 64 images")
    ap.add_argument("--arch-lr", type=float, default=3e-4)
    ap.add_argument("--tau-max", type=float, default=10.0)
    ap.add_argument("--tau-min", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)

    mean, std = [0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616]
    tf = transforms.Compose([transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(),
                             transforms.ToTensor(), transforms.Normalize(mean, std)])
    full = datasets.CIFAR10(args.data, train=True, transform=tf)
    split = torch.randperm(len(full), generator=torch.Generator().manual_seed(0)).tolist()
    w_set, a_set = Subset(full, split[:25000]), Subset(full, split[25000:])
    w_sampler, a_sampler = DistributedSampler(w_set, seed=args.seed), DistributedSampler(a_set, seed=args.seed)
    w_loader = DataLoader(w_set, args.batch_size, sampler=w_sampler, num_workers=4, pin_memory=True, drop_last=True)
    a_loader = DataLoader(a_set, args.batch_size, sampler=a_sampler, num_workers=4, pin_memory=True, drop_last=True)

    net = GDASNet().to(device)
    # a different op is sampled per edge on every rank and step
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)
    w_params = [p for n, p in net.named_parameters() if n != "arch_parameters"]
    w_opt = torch.optim.SGD(w_params, lr=args.lr * world, momentum=0.9, weight_decay=5e-4, nesterov=True)
    a_opt = torch.optim.Adam([net.arch_parameters], lr=args.arch_lr, betas=(0.5, 0.999), weight_decay=1e-3)
    w_sched = torch.optim.lr_scheduler.CosineAnnealingLR(w_opt, args.epochs, eta_min=1e-3)

    start_epoch = 0
    ckpt_path = os.path.join(args.out, "checkpoint.pth")
    if os.path.isfile(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        net.load_state_dict(ckpt["net"])
        w_opt.load_state_dict(ckpt["w_opt"])
        a_opt.load_state_dict(ckpt["a_opt"])
        w_sched.load_state_dict(ckpt["w_sched"])
        start_epoch = ckpt["epoch"] + 1

    for epoch in range(start_epoch, args.epochs):
        w_sampler.set_epoch(epoch)
        a_sampler.set_epoch(epoch)
        net.tau = args.tau_max - (args.tau_max - args.tau_min) * epoch / (args.epochs - 1)
        model.train()
        stats = torch.zeros(4, device=device)
        skipped = 0
        t0 = time.time()
        for step, ((xw, yw), (xa, ya)) in enumerate(zip(w_loader, a_loader)):
            xw, yw = xw.to(device, non_blocking=True), yw.to(device, non_blocking=True)
            xa, ya = xa.to(device, non_blocking=True), ya.to(device, non_blocking=True)

            w_opt.zero_grad(set_to_none=True)
            logits = model(xw)
            w_loss = F.cross_entropy(logits, yw)
            if not math.isfinite(w_loss.item()):
                skipped += 1
                continue
            w_loss.backward()
            nn.utils.clip_grad_norm_(w_params, 5)
            w_opt.step()

            a_opt.zero_grad(set_to_none=True)
            a_loss = F.cross_entropy(model(xa), ya)
            a_loss.backward()
            a_opt.step()

            stats += torch.stack([w_loss.detach() * yw.size(0), a_loss.detach() * ya.size(0),
                                  (logits.argmax(1) == yw).sum().float(), torch.tensor(float(yw.size(0)), device=device)])
        w_sched.step()
        dist.all_reduce(stats)
        if rank == 0:
            print(f"epoch {epoch} tau {net.tau:.2f} w_loss {(stats[0] / stats[3]).item():.3f} "
                  f"a_loss {(stats[1] / stats[3]).item():.3f} acc {(100 * stats[2] / stats[3]).item():.2f} "
                  f"skipped {skipped} {time.time() - t0:.0f}s", flush=True)
            print("genotype:", net.genotype(), flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"net": net.state_dict(), "w_opt": w_opt.state_dict(), "a_opt": a_opt.state_dict(),
                        "w_sched": w_sched.state_dict(), "epoch": epoch}, ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
