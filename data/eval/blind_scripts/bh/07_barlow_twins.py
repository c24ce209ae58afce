#!/usr/bin/env python
# Barlow Twins pre-training, ResNet-50 + 8192-8192-8192 projector, LARS.
#   torchrun --nproc_per_node=8 07_barlow_twins.py /datasets/imagenet --batch-size 2048
import argparse
import json
import math
import os
import random
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torchvision
import torchvision.transforms as transforms
from PIL import Image, ImageFilter, ImageOps
from torch import nn, optim

parser = argparse.ArgumentParser(description="Barlow Twins Training")
parser.add_argument("data", type=Path, metavar="DIR")
parser.add_argument("--workers", default=8, type=int)
parser.add_argument("--epochs", default=1000, type=int)
parser.add_argument("--batch-size", default=2048, type=int, help="total mini-batch size")
parser.add_argument("--learning-rate-weights", default=0.2, type=float)
parser.add_argument("--learning-rate-biases", default=0.0048, type=float)
parser.add_argument("--weight-decay", default=1e-6, type=float)
parser.add_argument("--lambd", default=0.0051, type=float)
parser.add_argument("--projector", default="8192-8192-8192", type=str)
parser.add_argument("--print-freq", default=100, type=int)
parser.add_argument("--checkpoint-dir", default="./checkpoint/", type=Path)
parser.add_argument("--local_rank", default=0, type=int)


def main():
    args = parser.parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    args.rank = dist.get_rank()
    args.world_size = dist.get_world_size()

    if args.rank == 0:
        args.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        stats_file = open(args.checkpoint_dir / "stats.txt", "a", buffering=1)
        print(" ".join(sys.argv))
        print(" ".join(sys.argv), file=stats_file)

    torch.backends.cudnn.benchmark = True

    model = BarlowTwins(args).cuda()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    param_weights, param_biases = [], []
    for param in model.parameters():
        if param.ndim == 1:
            param_biases.append(param)
        else:
            param_weights.append(param)
    parameters = [{"params": param_weights}, {"params": param_biases}]
    model = nn.parallel.DistributedDataParallel(model, device_ids=[args.local_rank])
    optimizer = LARS(parameters, lr=0, weight_decay=args.weight_decay,
                     weight_decay_filter=True, lars_adaptation_filter=True)

    ckpt_file = args.checkpoint_dir / "checkpoint.pth"
    if ckpt_file.is_file():
        ckpt = torch.load(ckpt_file, map_location="cpu")
        start_epoch = ckpt["epoch"]
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
    else:
        start_epoch = 0

    dataset = torchvision.datasets.ImageFolder(args.data / "train", Transform())
    sampler = torch.utils.data.distributed.DistributedSampler(dataset)
    assert args.batch_size % args.world_size == 0
    per_device_batch_size = args.batch_size // args.world_size
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=per_device_batch_size, num_workers=args.workers,
        pin_memory=True, sampler=sampler, drop_last=True)

    start_time = time.time()
    scaler = torch.cuda.amp.GradScaler()
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        for step, ((y1, y2), _) in enumerate(loader, start=epoch * len(loader)):
            y1 = y1.cuda(non_blocking=True)
            y2 = y2.cuda(non_blocking=True)
            adjust_learning_rate(args, optimizer, loader, step)
            optimizer.zero_grad()
            with torch.cuda.amp.autocast():
                loss = model.forward(y1, y2)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if step % args.print_freq == 0 and args.rank == 0:
                stats = dict(epoch=epoch, step=step,
                             lr_weights=optimizer.param_groups[0]["lr"],
                             lr_biases=optimizer.param_groups[1]["lr"],
                             loss=loss.item(), time=int(time.time() - start_time))
                print(json.dumps(stats))
                print(json.dumps(stats), file=stats_file)
        if args.rank == 0:
            state = dict(epoch=epoch + 1, model=model.state_dict(), optimizer=optimizer.state_dict())
            torch.save(state, args.checkpoint_dir / "checkpoint.pth")
    if args.rank == 0:
        torch.save(model.module.backbone.state_dict(), args.checkpoint_dir / "resnet50.pth")
    dist.destroy_process_group()


def adjust_learning_rate(args, optimizer, loader, step):
    max_steps = args.epochs * len(loader)
    warmup_steps = 10 * len(loader)
    base_lr = args.batch_size / 256
    if step < warmup_steps:
        lr = base_lr * step / warmup_steps
    else:
        step -= warmup_steps
        max_steps -= warmup_steps
        q = 0.5 * (1 + math.cos(math.pi * step / max_steps))
        end_lr = base_lr * 0.001
        lr = base_lr * q + end_lr * (1 - q)
    optimizer.param_groups[0]["lr"] = lr * args.learning_rate_weights
    optimizer.param_groups[1]["lr"] = lr * args.learning_rate_biases


def off_diagonal(x):
    n, m = x.shape
    assert n == m
    return x.flatten()[:-1].view(n - 1, n + 1)[:, 1:].flatten()


class BarlowTwins(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.backbone = torchvision.models.resnet50(zero_init_residual=True)
        self.backbone.fc = nn.Identity()
        sizes = [2048] + list(map(int, args.projector.split("-")))
        layers = []
        for i in range(len(sizes) - 2):
            layers.append(nn.Linear(sizes[i], sizes[i + 1], bias=False))
            layers.append(nn.BatchNorm1d(sizes[i + 1]))
            layers.append(nn.ReLU(inplace=True))
        layers.append(nn.Linear(sizes[-2], sizes[-1], bias=False))
        self.projector = nn.Sequential(*layers)
        self.bn = nn.BatchNorm1d(sizes[-1], affine=False)

    def forward(self, y1, y2):
        z1 = self.projector(self.backbone(y1))
        z2 = self.projector(self.backbone(y2))
        # empirical cross-correlation matrix over the global batch
        c = self.bn(z1).float().T @ self.bn(z2).float()
        c.div_(self.args.batch_size)
        dist.all_reduce(c)
        on_diag = torch.diagonal(c).add_(-1).pow_(2).sum()
        off_diag = off_diagonal(c).pow_(2).sum()
        return on_diag + self.args.lambd * off_diag


class LARS(optim.Optimizer):
    def __init__(self, params, lr, weight_decay=0, momentum=0.9, eta=0.001,
                 weight_decay_filter=False, lars_adaptation_filter=False):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, eta=eta,
                        weight_decay_filter=weight_decay_filter,
                        lars_adaptation_filter=lars_adaptation_filter)
        super().__init__(params, defaults)

    def exclude_bias_and_norm(self, p):
        return p.ndim == 1

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                dp = p.grad
                if dp is None:
                    continue
                if not g["weight_decay_filter"] or not self.exclude_bias_and_norm(p):
                    dp = dp.add(p, alpha=g["weight_decay"])
                if not g["lars_adaptation_filter"] or not self.exclude_bias_and_norm(p):
                    param_norm = torch.norm(p)
                    update_norm = torch.norm(dp)
                    one = torch.ones_like(param_norm)
                    q = torch.where(param_norm > 0.,
                                    torch.where(update_norm > 0, (g["eta"] * param_norm / update_norm), one),
                                    one)
                    dp = dp.mul(q)
                param_state = self.state[p]
                if "mu" not in param_state:
                    param_state["mu"] = torch.zeros_like(p)
                mu = param_state["mu"]
                mu.mul_(g["momentum"]).add_(dp)
                p.add_(mu, alpha=-g["lr"])


class GaussianBlur(object):
    def __init__(self, p):
        self.p = p

    def __call__(self, img):
        if random.random() < self.p:
            sigma = random.random() * 1.9 + 0.1
            return img.filter(ImageFilter.GaussianBlur(sigma))
        return img


class Solarization(object):
    def __init__(self, p):
        self.p = p

    def __call__(self, img):
        return ImageOps.solarize(img) if random.random() < self.p else img


class Transform:
    def __init__(self):
        normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
        common = [
            transforms.RandomResizedCrop(224, interpolation=Image.BICUBIC),
            transforms.RandomHorizontalFlip(p=0.5),
            transforms.RandomApply([transforms.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
            transforms.RandomGrayscale(p=0.2),
        ]
        self.transform = transforms.Compose(common + [GaussianBlur(p=1.0), Solarization(p=0.0),
                                                      transforms.ToTensor(), normalize])
        self.transform_prime = transforms.Compose(common + [GaussianBlur(p=0.1), Solarization(p=0.2),
                                                            transforms.ToTensor(), normalize])

    def __call__(self, x):
        return self.transform(x), self.transform_prime(x)


if __name__ == "__main__":
    main()
