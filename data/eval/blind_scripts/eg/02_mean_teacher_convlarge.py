"""Mean Teacher (Tarvainen & Valpola, 2017) on CIFAR-10 with the 13-layer ConvNet.

Launch with torchrun; each process drives one GPU.  The teacher is an EMA of the
student and is kept outside DDP.
"""
import argparse
import json
import os
import time
from copy import deepcopy

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)

DEFAULTS = dict(
    labels=4000,
    labeled_batch=64,        # global batch sizes (256 in total, as in the paper), split over the GPUs
    unlabeled_batch=192,
    epochs=180,
    lr=0.2,
    lr_rampup=5,
    nesterov=True,
    weight_decay=2e-4,
    ema_decay=0.97,
    consistency=100.0,
    consistency_rampup=5,
    workers=4,
)


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/datasets/cifar10")
    p.add_argument("--out", default="checkpoints/mt_cifar10")
    p.add_argument("--split-seed", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    for k, v in DEFAULTS.items():
        t = type(v) if not isinstance(v, bool) else lambda s: s.lower() in ("1", "true", "yes")
        p.add_argument("--" + k.replace("_", "-"), type=t, default=v)
    return p.parse_args()


def conv_bn(cin, cout, k, pad):
    return [nn.Conv2d(cin, cout, k, padding=pad), nn.BatchNorm2d(cout), nn.LeakyReLU(0.1)]


class ConvLarge(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        layers = []
        layers += conv_bn(3, 128, 3, 1) + conv_bn(128, 128, 3, 1) + conv_bn(128, 128, 3, 1)
        layers += [nn.MaxPool2d(2, 2), nn.Dropout(0.5)]
        layers += conv_bn(128, 256, 3, 1) + conv_bn(256, 256, 3, 1) + conv_bn(256, 256, 3, 1)
        layers += [nn.MaxPool2d(2, 2), nn.Dropout(0.5)]
        layers += conv_bn(256, 512, 3, 0) + conv_bn(512, 256, 1, 0) + conv_bn(256, 128, 1, 0)
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(128, num_classes)

    def forward(self, x):
        return self.classifier(self.features(x))


def sigmoid_rampup(current, length):
    if length == 0:
        return 1.0
    t = np.clip(current / length, 0.0, 1.0)
    return float(np.exp(-5.0 * (1.0 - t) ** 2))


def adjust_lr(optimizer, cfg, epoch, step, steps_per_epoch):
    e = epoch + step / steps_per_epoch
    lr = cfg.lr * min(1.0, e / max(cfg.lr_rampup, 1e-8))
    lr *= 0.5 * (np.cos(np.pi * e / cfg.epochs) + 1.0)
    for g in optimizer.param_groups:
        g["lr"] = lr
    return lr


@torch.no_grad()
def update_teacher(student, teacher, alpha, global_step):
    alpha = min(1.0 - 1.0 / (global_step + 1), alpha)
    for t, s in zip(teacher.parameters(), student.parameters()):
        t.mul_(alpha).add_(s.detach(), alpha=1.0 - alpha)


def balanced_split(targets, n_labels, seed):
    rng = np.random.RandomState(seed)
    targets = np.asarray(targets)
    classes = np.unique(targets)
    per_class = n_labels // len(classes)
    lab = np.concatenate([rng.choice(np.where(targets == c)[0], per_class, replace=False) for c in classes])
    unlab = np.setdiff1d(np.arange(len(targets)), lab)
    return lab, unlab


class TwoViews:
    def __init__(self, t):
        self.t = t

    def __call__(self, x):
        return self.t(x), self.t(x)


@torch.no_grad()
def evaluate(net, dataset, device, rank, world):
    """Each rank scores a strided slice of the test set; counts are summed over ranks."""
    net.eval()
    shard = Subset(dataset, list(range(rank, len(dataset), world)))
    loader = DataLoader(shard, batch_size=500, shuffle=False, num_workers=2)
    stats = torch.zeros(2, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        stats[0] += (net(x).argmax(1) == y).sum()
        stats[1] += y.numel()
    dist.all_reduce(stats)
    return (100.0 * stats[0] / stats[1]).item()


def main():
    cfg = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(cfg.seed)
    assert cfg.labeled_batch % world == 0 and cfg.unlabeled_batch % world == 0
    lab_bs, unl_bs = cfg.labeled_batch // world, cfg.unlabeled_batch // world

    aug = transforms.Compose([
        transforms.RandomCrop(32, padding=2, padding_mode="reflect"),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(MEAN, STD),
    ])
    test_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(MEAN, STD)])

    if rank == 0:
        datasets.CIFAR10(cfg.data, train=True, download=True)
        datasets.CIFAR10(cfg.data, train=False, download=True)
    dist.barrier()

    train_lab = datasets.CIFAR10(cfg.data, train=True, transform=TwoViews(aug))
    train_unl = datasets.CIFAR10(cfg.data, train=True, transform=TwoViews(aug))
    test_set = datasets.CIFAR10(cfg.data, train=False, transform=test_tf)
    lab_idx, unl_idx = balanced_split(train_lab.targets, cfg.labels, cfg.split_seed)
    lab_set, unl_set = Subset(train_lab, lab_idx), Subset(train_unl, unl_idx)

    lab_sampler = DistributedSampler(lab_set, shuffle=True, seed=cfg.seed, drop_last=True)
    unl_sampler = DistributedSampler(unl_set, shuffle=True, seed=cfg.seed, drop_last=True)
    lab_loader = DataLoader(lab_set, batch_size=lab_bs, sampler=lab_sampler,
                            num_workers=cfg.workers, pin_memory=True, drop_last=True)
    unl_loader = DataLoader(unl_set, batch_size=unl_bs, sampler=unl_sampler,
                            num_workers=cfg.workers, pin_memory=True, drop_last=True,
                            persistent_workers=True)

    student = ConvLarge().to(device)
    teacher = deepcopy(student)
    for p in teacher.parameters():
        p.requires_grad_(False)
    student = nn.SyncBatchNorm.convert_sync_batchnorm(student)
    student = DDP(student, device_ids=[local_rank])
    torch.manual_seed(cfg.seed + rank)  # different augmentation / dropout streams per rank

    optimizer = torch.optim.SGD(student.parameters(), lr=cfg.lr, momentum=0.9,
                                nesterov=cfg.nesterov, weight_decay=cfg.weight_decay)

    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)
        with open(os.path.join(cfg.out, "config.json"), "w") as f:
            json.dump(vars(cfg), f, indent=2)

    steps_per_epoch = len(unl_loader)
    global_step, lab_epoch, best = 0, 0, 0.0
    lab_iter = iter(lab_loader)
    for epoch in range(cfg.epochs):
        unl_sampler.set_epoch(epoch)
        student.train()
        teacher.train()
        t0 = time.time()
        running = torch.zeros(3, device=device)
        for i, ((u1, u2), _) in enumerate(unl_loader):
            try:
                (l1, l2), y = next(lab_iter)
            except StopIteration:
                lab_epoch += 1
                lab_sampler.set_epoch(lab_epoch)
                lab_iter = iter(lab_loader)
                (l1, l2), y = next(lab_iter)
            lr = adjust_lr(optimizer, cfg, epoch, i, steps_per_epoch)

            n_l = l1.size(0)
            x_student = torch.cat([l1, u1]).to(device, non_blocking=True)
            x_teacher = torch.cat([l2, u2]).to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)

            out_s = student(x_student)
            with torch.no_grad():
                out_t = teacher(x_teacher)

            class_loss = F.cross_entropy(out_s[:n_l], y)
            w = cfg.consistency * sigmoid_rampup(epoch + i / steps_per_epoch, cfg.consistency_rampup)
            cons_loss = F.mse_loss(out_s.softmax(1), out_t.softmax(1), reduction="sum") / 10 / out_s.size(0)
            loss = class_loss + w * cons_loss

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            global_step += 1
            update_teacher(student.module, teacher, cfg.ema_decay, global_step)

            running += torch.stack([loss.detach(), class_loss.detach(), cons_loss.detach()])
            if rank == 0 and i % 100 == 0:
                print(f"ep {epoch} it {i}/{steps_per_epoch} lr {lr:.4f} loss {loss.item():.4f} "
                      f"cls {class_loss.item():.4f} cons {cons_loss.item():.5f} w {w:.2f}", flush=True)

        dist.all_reduce(running)
        running /= world * steps_per_epoch
        acc_s = evaluate(student.module, test_set, device, rank, world)
        acc_t = evaluate(teacher, test_set, device, rank, world)
        if rank == 0:
            print(f"== epoch {epoch} done in {time.time() - t0:.0f}s | loss {running[0]:.4f} "
                  f"| student {acc_s:.2f} teacher {acc_t:.2f}", flush=True)
            ckpt = {"epoch": epoch + 1, "global_step": global_step,
                    "student": student.module.state_dict(), "teacher": teacher.state_dict(),
                    "optimizer": optimizer.state_dict(), "acc_teacher": acc_t}
            torch.save(ckpt, os.path.join(cfg.out, "last.pt"))
            if acc_t > best:
                best = acc_t
                torch.save(ckpt, os.path.join(cfg.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
