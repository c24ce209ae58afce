#!/usr/bin/env python
# Pooled-output (POD-spatial) distillation for class-incremental CIFAR-100, B50 + 5 x 10.
#
# The model of the previous step is reloaded from its checkpoint and used as a
# frozen teacher; the student starts from the same weights.
#
#   torchrun --nproc_per_node=4 12_pod_spatial_distill.py --workdir /mnt/shared/pod_c100
import argparse
import logging
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from torchvision.models import resnet18

logger = logging.getLogger("pod")


def parse_args(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/mnt/shared/data/cifar100")
    ap.add_argument("--workdir", default="/mnt/shared/pod_c100")
    ap.add_argument("--base", type=int, default=50)
    ap.add_argument("--inc", type=int, default=10)
    ap.add_argument("--mem", type=int, default=20, help="exemplars per class")
    ap.add_argument("--epochs", type=int, default=160)
    ap.add_argument("--inc-epochs", type=int, default=90)
    ap.add_argument("--batch-size", type=int, default=128, help="global")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--pod-weight", type=float, default=3.0)
    ap.add_argument("--workers", type=int, default=4)
    return ap.parse_args(argv)


class Net(nn.Module):
    """ResNet-18 for 32x32 inputs that also returns the four stage outputs."""

    def __init__(self, n_classes=100):
        super().__init__()
        r = resnet18()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), r.bn1, r.relu)
        self.stages = nn.ModuleList([r.layer1, r.layer2, r.layer3, r.layer4])
        self.head = nn.Linear(512, n_classes)

    def forward(self, x):
        x = self.stem(x)
        maps = []
        for s in self.stages:
            x = s(x)
            maps.append(x)
        logits = self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))
        return logits, maps


def pod_spatial(maps_s, maps_t):
    loss = 0.0
    for a, b in zip(maps_s, maps_t):
        a, b = a.pow(2), b.pow(2)
        a = torch.cat([a.sum(dim=3).flatten(1), a.sum(dim=2).flatten(1)], dim=1)
        b = torch.cat([b.sum(dim=3).flatten(1), b.sum(dim=2).flatten(1)], dim=1)
        loss = loss + (F.normalize(a, dim=1) - F.normalize(b, dim=1)).norm(dim=1).mean()
    return loss / len(maps_s)


def setup_logging(rank):
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter(f"%(asctime)s [rank{rank}] %(message)s"))
    logger.addHandler(h)
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)


@torch.no_grad()
def top1(net, ds, labels, n_known, device, rank, world):
    net.eval()
    idx = np.where(labels < n_known)[0][rank::world]
    acc = torch.zeros(2, device=device)
    for x, y in DataLoader(Subset(ds, idx), batch_size=512, num_workers=2):
        x, y = x.to(device), y.to(device)
        acc[0] += (net(x)[0][:, :n_known].argmax(1) == y).sum()
        acc[1] += y.numel()
    dist.all_reduce(acc)
    net.train()
    return (100.0 * acc[0] / acc[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    setup_logging(rank)
    torch.manual_seed(0)

    mean, std = (0.5071, 0.4867, 0.4408), (0.2675, 0.2565, 0.2761)
    aug = transforms.Compose([transforms.RandomCrop(32, 4), transforms.RandomHorizontalFlip(),
                              transforms.ColorJitter(63 / 255), transforms.ToTensor(),
                              transforms.Normalize(mean, std)])
    plain = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])
    train_set = datasets.CIFAR100(args.data, train=True, transform=aug)
    test_set = datasets.CIFAR100(args.data, train=False, transform=plain)
    y_train, y_test = np.array(train_set.targets), np.array(test_set.targets)

    schedule = [(0, args.base)] + [(c, c + args.inc) for c in range(args.base, 100, args.inc)]
    exemplars = []
    accs = []
    os.makedirs(args.workdir, exist_ok=True)
    per_gpu = args.batch_size // world

    net = Net().to(device)
    model = DDP(net, device_ids=[local_rank])
    teacher = None

    for step, (lo, hi) in enumerate(schedule):
        if step > 0:
            teacher = Net().to(device)
            state = torch.load(os.path.join(args.workdir, f"step{step - 1}.pt"), map_location=device)
            teacher.load_state_dict(state)
            teacher.eval().requires_grad_(False)

        idx = np.where((y_train >= lo) & (y_train < hi))[0].tolist() + exemplars
        ds = Subset(train_set, idx)
        sampler = DistributedSampler(ds, shuffle=True)
        loader = DataLoader(ds, batch_size=per_gpu, sampler=sampler, num_workers=args.workers,
                            pin_memory=True, drop_last=True)
        epochs = args.epochs if step == 0 else args.inc_epochs
        lr = args.lr if step == 0 else args.lr * 0.5
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs)
        pod_lambda = args.pod_weight * np.sqrt(hi / (hi - lo)) if step > 0 else 0.0

        for ep in range(epochs):
            sampler.set_epoch(ep)
            run_ce = run_pod = 0.0
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                logits, maps = model(x)
                loss_ce = F.cross_entropy(logits[:, :hi], y)
                loss_pod = torch.zeros((), device=device)
                if teacher is not None:
                    with torch.no_grad():
                        _, t_maps = teacher(x)
                    loss_pod = pod_spatial(maps, t_maps)
                loss = loss_ce + pod_lambda * loss_pod
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                run_ce += loss_ce.item()
                run_pod += loss_pod.item()
            sched.step()
            if ep % 10 == 0 or ep == epochs - 1:
                logger.info("step %d ep %3d ce %.4f pod %.4f", step, ep, run_ce / len(loader), run_pod / len(loader))

        acc = top1(net, test_set, y_test, hi, device, rank, world)
        accs.append(acc)
        logger.info("step %d: %d classes, top-1 %.2f (avg inc %.2f)", step, hi, acc, float(np.mean(accs)))

        # random exemplars, fixed generator so every rank picks the same ones
        g = np.random.default_rng(1000 + step)
        for c in range(lo, hi):
            exemplars += g.choice(np.where(y_train == c)[0], args.mem, replace=False).tolist()

        if rank == 0:
            torch.save(model.state_dict(), os.path.join(args.workdir, f"step{step}.pt"))
        dist.barrier()

    logger.info("accuracies per step: %s", ", ".join(f"{a:.2f}" for a in accs))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
