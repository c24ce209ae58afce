"""Shampoo (Gupta et al., 2018) with grafting onto SGD, CIFAR-10 ResNet-32 (GroupNorm).

Preconditioners are recomputed every --precond-every steps (eigendecomposition,
fp64), every rank holds the full preconditioners; gradients are averaged by DDP.

    torchrun --nproc_per_node=4 shampoo_resnet.py --precond-every 20
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
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def matrix_power(mat, power, eps):
    mat = mat.double()
    evals, evecs = torch.linalg.eigh(mat + eps * torch.eye(mat.size(0), device=mat.device, dtype=mat.dtype))
    evals = evals.clamp(min=eps)
    return (evecs @ torch.diag(evals.pow(power)) @ evecs.t()).float()


class Shampoo(Optimizer):
    def __init__(self, params, lr=0.1, momentum=0.9, weight_decay=0.0, eps=1e-6,
                 precond_every=20, start_precond=100, max_dim=2048):
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eps=eps)
        super().__init__(params, defaults)
        self.precond_every = precond_every
        self.start_precond = start_precond
        self.max_dim = max_dim
        self._step = 0

    @torch.no_grad()
    def step(self, closure=None):
        self._step += 1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if group["weight_decay"]:
                    g = g.add(p, alpha=group["weight_decay"])
                state = self.state[p]
                g2 = g.reshape(g.size(0), -1) if g.ndim > 1 else None
                use_shampoo = g2 is not None and max(g2.shape) <= self.max_dim
                if len(state) == 0:
                    state["mom"] = torch.zeros_like(p)
                    if use_shampoo:
                        m, n = g2.shape
                        state["L"] = group["eps"] * torch.eye(m, device=p.device)
                        state["R"] = group["eps"] * torch.eye(n, device=p.device)
                        state["L_inv"] = torch.eye(m, device=p.device)
                        state["R_inv"] = torch.eye(n, device=p.device)
                if use_shampoo:
                    state["L"].add_(g2 @ g2.t())
                    state["R"].add_(g2.t() @ g2)
                    if self._step >= self.start_precond and self._step % self.precond_every == 0:
                        state["L_inv"] = matrix_power(state["L"], -0.25, group["eps"])
                        state["R_inv"] = matrix_power(state["R"], -0.25, group["eps"])
                    pre = state["L_inv"] @ g2 @ state["R_inv"]
                    # layer-wise grafting: Shampoo direction, SGD step size
                    pre = pre * (g2.norm() / pre.norm().clamp(min=1e-16))
                    d = pre.view_as(p)
                else:
                    d = g
                state["mom"].mul_(group["momentum"]).add_(d)
                p.add_(state["mom"], alpha=-group["lr"])
        return None


class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.n1 = nn.GroupNorm(8, cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.n2 = nn.GroupNorm(8, cout)
        self.skip = None
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.GroupNorm(8, cout))

    def forward(self, x):
        h = F.relu(self.n1(self.c1(x)))
        h = self.n2(self.c2(h))
        return F.relu(h + (x if self.skip is None else self.skip(x)))


class ResNet32(nn.Module):
    def __init__(self, num_classes=10, width=16):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.GroupNorm(8, width), nn.ReLU())
        layers, cin = [], width
        for i, w in enumerate([width, 2 * width, 4 * width]):
            for j in range(5):
                layers.append(Block(cin, w, 2 if (j == 0 and i > 0) else 1))
                cin = w
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        return self.fc(F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1).flatten(1))


def evaluate(model, loader, device):
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            out = model(x)
            loss_sum += F.cross_entropy(out, y, reduction="sum").item()
            correct += (out.argmax(1) == y).sum().item()
            total += y.size(0)
    stats = torch.tensor([loss_sum, correct, total], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    model.train()
    return stats[0].item() / stats[2].item(), stats[1].item() / stats[2].item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/cifar10")
    ap.add_argument("--out", default="runs/shampoo_r32")
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=128, help="per GPU")
    ap.add_argument("--lr", type=float, default=0.1, help="for a global batch of 128, scaled linearly")
    ap.add_argument("--wd", type=float, default=5e-4)
    ap.add_argument("--precond-every", type=int, default=20)
    ap.add_argument("--start-precond", type=int, default=100)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    norm = transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    train_set = datasets.CIFAR10(args.data, train=True, download=False, transform=transforms.Compose(
        [transforms.RandomCrop(32, 4), transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm]))
    test_set = datasets.CIFAR10(args.data, train=False, download=False,
                                transform=transforms.Compose([transforms.ToTensor(), norm]))
    train_sampler = DistributedSampler(train_set, shuffle=True)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=500, sampler=test_sampler, num_workers=4, pin_memory=True)

    model = DDP(ResNet32().to(device), device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 128
    optimizer = Shampoo(model.parameters(), lr=lr, weight_decay=args.wd,
                        precond_every=args.precond_every, start_precond=args.start_precond)
    total = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 500) * 0.5 * (1 + math.cos(math.pi * s / total)))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
        test_loss, test_acc = evaluate(model, test_loader, device)
        if rank == 0:
            print(f"epoch {epoch:3d} loss {loss.item():.4f} test_loss {test_loss:.4f} "
                  f"test_acc {test_acc:.4f} time {time.time() - t0:.1f}s", flush=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch, "args": vars(args)}, os.path.join(args.out, "last.pt"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
