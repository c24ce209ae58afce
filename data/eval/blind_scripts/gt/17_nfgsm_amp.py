"""N-FGSM single-step adversarial training (de Jorge et al., NeurIPS 2022) with
fp16 autocast, PreActResNet-18 / CIFAR-10, multi-GPU.

Noise of magnitude k*eps (k=2), one FGSM step of size eps, no projection.

    torchrun --nproc_per_node=4 17_nfgsm_amp.py --eps 8 --epochs 30 --out runs/nfgsm_eps8
"""
import argparse
import csv
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.cuda.amp import GradScaler, autocast
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

from preact_resnet import PreActResNet18

MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2471, 0.2435, 0.2616)


class WithNormalization(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net
        self.register_buffer("mean", torch.tensor(MEAN).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(STD).view(1, 3, 1, 1))

    def forward(self, x):
        return self.net((x - self.mean) / self.std)


def nfgsm_example(model, x, y, eps, k, step):
    noise = torch.empty_like(x).uniform_(-k * eps, k * eps)
    x_noisy = (x + noise).clamp(0, 1).requires_grad_(True)
    with autocast():
        loss = F.cross_entropy(model(x_noisy), y)
    grad, = torch.autograd.grad(loss, x_noisy)
    return (x_noisy.detach() + step * grad.sign()).clamp(0, 1)


def pgd_eval(model, x, y, eps, alpha, steps):
    x_adv = (x + torch.empty_like(x).uniform_(-eps, eps)).clamp(0, 1)
    for _ in range(steps):
        x_adv.requires_grad_(True)
        loss = F.cross_entropy(model(x_adv).float(), y)
        g, = torch.autograd.grad(loss, x_adv)
        x_adv = torch.min(torch.max(x_adv.detach() + alpha * g.sign(), x - eps), x + eps).clamp(0, 1)
    return x_adv.detach()


def test(model, loader, eps, device):
    model.eval()
    r = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        x_adv = pgd_eval(model, x, y, eps, eps / 4, 50)
        with torch.no_grad():
            r[0] += (model(x).argmax(1) == y).sum()
            r[1] += (model(x_adv).argmax(1) == y).sum()
        r[2] += y.size(0)
    dist.all_reduce(r)
    return (r[0] / r[2]).item(), (r[1] / r[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="./data")
    ap.add_argument("--out", default="runs/nfgsm")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=128, help="global")
    ap.add_argument("--lr-max", type=float, default=0.2)
    ap.add_argument("--wd", type=float, default=5e-4)
    ap.add_argument("--eps", type=float, default=8.0)
    ap.add_argument("--k", type=float, default=2.0)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    train_set = datasets.CIFAR10(args.data, train=True, transform=transforms.Compose([
        transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(), transforms.ToTensor()]))
    test_set = datasets.CIFAR10(args.data, train=False, transform=transforms.ToTensor())
    sampler = DistributedSampler(train_set, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size // world, sampler=sampler,
                        num_workers=args.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=500, sampler=DistributedSampler(test_set, shuffle=False),
                             num_workers=args.workers, pin_memory=True)

    model = DDP(WithNormalization(PreActResNet18()).to(device), device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr_max, momentum=0.9, weight_decay=args.wd)
    total = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr_max, total_steps=total,
                                                pct_start=0.5, anneal_strategy="linear",
                                                cycle_momentum=False)
    scaler = GradScaler()
    eps = args.eps / 255.0

    if rank == 0:
        log_f = open(os.path.join(args.out, "log.csv"), "w", newline="")
        log_w = csv.writer(log_f)
        log_w.writerow(["epoch", "train_loss", "train_acc", "skipped", "time"])

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        m = torch.zeros(4, device=device)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x_adv = nfgsm_example(model, x, y, eps, args.k, eps)
            with autocast():
                out = model(x_adv)
                loss = F.cross_entropy(out, y)
            if not torch.isfinite(loss):
                m[3] += 1
                continue
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            m[0] += loss.detach().float() * y.size(0)
            m[1] += (out.argmax(1) == y).sum()
            m[2] += y.size(0)
        dist.all_reduce(m)
        if rank == 0:
            row = [epoch, (m[0] / m[2]).item(), (m[1] / m[2]).item(), int(m[3].item()), time.time() - tic]
            log_w.writerow(row)
            log_f.flush()
            print("epoch %d loss %.4f acc %.4f skipped %d (%.0fs)" % tuple(row), flush=True)
            torch.save(model.module.state_dict(), os.path.join(args.out, "last.pth"))

    clean, robust = test(model.module, test_loader, eps, device)
    if rank == 0:
        print(f"final: clean {clean:.4f}  PGD-50 {robust:.4f}")
        with open(os.path.join(args.out, "final.txt"), "w") as f:
            f.write(f"clean {clean:.4f}\npgd50 {robust:.4f}\n")
        log_f.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
