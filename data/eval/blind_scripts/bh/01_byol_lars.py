#!/usr/bin/env python
"""BYOL pre-training on ImageNet with LARS and a cosine EMA schedule.

Launch with torchrun, one process per GPU.
"""
import argparse
import copy
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from PIL import ImageFilter, ImageOps
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def get_args():
    p = argparse.ArgumentParser("BYOL pre-training")
    p.add_argument("--data", default="/datasets/imagenet/train")
    p.add_argument("--output-dir", default="./checkpoints/byol_r50")
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--warmup-epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=128, help="per-GPU batch size")
    p.add_argument("--base-lr", type=float, default=0.2, help="lr for a total batch of 256")
    p.add_argument("--weight-decay", type=float, default=1.5e-6)
    p.add_argument("--base-momentum", type=float, default=0.996)
    p.add_argument("--proj-dim", type=int, default=256)
    p.add_argument("--hidden-dim", type=int, default=4096)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--resume", default="")
    p.add_argument("--print-freq", type=int, default=50)
    p.add_argument("--save-freq", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class GaussianBlur:
    def __init__(self, p, sigma=(0.1, 2.0)):
        self.p = p
        self.sigma = sigma

    def __call__(self, img):
        if np.random.rand() > self.p:
            return img
        return img.filter(ImageFilter.GaussianBlur(radius=np.random.uniform(*self.sigma)))


class Solarize:
    def __init__(self, p):
        self.p = p

    def __call__(self, img):
        return ImageOps.solarize(img) if np.random.rand() < self.p else img


class TwoViews:
    def __init__(self, t1, t2):
        self.t1 = t1
        self.t2 = t2

    def __call__(self, img):
        return self.t1(img), self.t2(img)


def byol_transforms():
    normalize = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])

    def view(blur_p, sol_p):
        return T.Compose([
            T.RandomResizedCrop(224, scale=(0.08, 1.0), interpolation=T.InterpolationMode.BICUBIC),
            T.RandomHorizontalFlip(),
            T.RandomApply([T.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
            T.RandomGrayscale(p=0.2),
            GaussianBlur(blur_p),
            Solarize(sol_p),
            T.ToTensor(),
            normalize,
        ])

    return TwoViews(view(1.0, 0.0), view(0.1, 0.2))


class MLP(nn.Module):
    def __init__(self, in_dim, hidden_dim, out_dim):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(in_dim, hidden_dim),
            nn.BatchNorm1d(hidden_dim),
            nn.ReLU(inplace=True),
            nn.Linear(hidden_dim, out_dim),
        )

    def forward(self, x):
        return self.net(x)


def regression_loss(p, z):
    p = F.normalize(p, dim=-1)
    z = F.normalize(z, dim=-1)
    return 2 - 2 * (p * z).sum(dim=-1)


class BYOL(nn.Module):
    def __init__(self, arch, hidden_dim, proj_dim):
        super().__init__()
        backbone = torchvision.models.__dict__[arch]()
        feat_dim = backbone.fc.in_features
        backbone.fc = nn.Identity()
        self.online_encoder = nn.Sequential(backbone, MLP(feat_dim, hidden_dim, proj_dim))
        self.online_predictor = MLP(proj_dim, hidden_dim, proj_dim)
        self.target_encoder = copy.deepcopy(self.online_encoder)
        for p in self.target_encoder.parameters():
            p.requires_grad = False

    @torch.no_grad()
    def update_target(self, tau):
        for po, pt in zip(self.online_encoder.parameters(), self.target_encoder.parameters()):
            pt.mul_(tau).add_(po.detach(), alpha=1.0 - tau)

    def forward(self, x1, x2):
        p1 = self.online_predictor(self.online_encoder(x1))
        p2 = self.online_predictor(self.online_encoder(x2))
        with torch.no_grad():
            z1 = self.target_encoder(x1)
            z2 = self.target_encoder(x2)
        return (regression_loss(p1, z2) + regression_loss(p2, z1)).mean()


class LARS(torch.optim.Optimizer):
    """LARS without adaptation / weight decay for biases and norm parameters."""

    def __init__(self, params, lr=0.0, weight_decay=0.0, momentum=0.9, eta=0.001):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, eta=eta))

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                dp = p.grad
                if p.ndim > 1:
                    dp = dp.add(p, alpha=g["weight_decay"])
                    param_norm = torch.norm(p)
                    update_norm = torch.norm(dp)
                    one = torch.ones_like(param_norm)
                    q = torch.where(param_norm > 0.0,
                                    torch.where(update_norm > 0, g["eta"] * param_norm / update_norm, one),
                                    one)
                    dp = dp.mul(q)
                state = self.state[p]
                if "mu" not in state:
                    state["mu"] = torch.zeros_like(p)
                mu = state["mu"]
                mu.mul_(g["momentum"]).add_(dp)
                p.add_(mu, alpha=-g["lr"])


def cosine_schedule(base, final, epochs, iters_per_epoch, warmup_epochs=0):
    warmup_iters = warmup_epochs * iters_per_epoch
    warmup = np.linspace(0.0, base, warmup_iters) if warmup_iters > 0 else np.array([])
    iters = np.arange(epochs * iters_per_epoch - warmup_iters)
    cos = final + 0.5 * (base - final) * (1 + np.cos(np.pi * iters / len(iters)))
    return np.concatenate((warmup, cos))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    is_main = rank == 0

    torch.manual_seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.backends.cudnn.benchmark = True

    dataset = torchvision.datasets.ImageFolder(args.data, transform=byol_transforms())
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = BYOL(args.arch, args.hidden_dim, args.proj_dim)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda()
    model = DDP(model, device_ids=[local_rank])

    global_batch = args.batch_size * world_size
    lr = args.base_lr * global_batch / 256
    optimizer = LARS(model.parameters(), lr=lr, weight_decay=args.weight_decay)
    scaler = torch.cuda.amp.GradScaler()

    iters_per_epoch = len(loader)
    lr_schedule = cosine_schedule(lr, 0.0, args.epochs, iters_per_epoch, args.warmup_epochs)
    # tau goes from base_momentum to 1 over training
    momentum_schedule = cosine_schedule(1.0 - args.base_momentum, 0.0, args.epochs, iters_per_epoch)
    momentum_schedule = 1.0 - momentum_schedule

    start_epoch = 0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"]
        if is_main:
            print(f"resumed from {args.resume} at epoch {start_epoch}")

    writer = None
    if is_main:
        os.makedirs(args.output_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.output_dir, "tb"))
        print(f"world size {world_size}, global batch {global_batch}, peak lr {lr:.4f}")

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, ((x1, x2), _) in enumerate(loader):
            step = epoch * iters_per_epoch + it
            for g in optimizer.param_groups:
                g["lr"] = lr_schedule[step]

            x1 = x1.cuda(non_blocking=True)
            x2 = x2.cuda(non_blocking=True)
            with torch.cuda.amp.autocast():
                loss = model(x1, x2)

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()

            model.update_target(momentum_schedule[step])

            if it % args.print_freq == 0:
                loss_avg = loss.detach().clone()
                dist.all_reduce(loss_avg)
                loss_avg /= world_size
                if is_main:
                    print(f"ep {epoch} it {it}/{iters_per_epoch} loss {loss_avg.item():.4f} "
                          f"lr {lr_schedule[step]:.4f} tau {momentum_schedule[step]:.5f} "
                          f"{(time.time() - t0) / (it + 1):.3f}s/it")
                    writer.add_scalar("train/loss", loss_avg.item(), step)
                    writer.add_scalar("train/lr", lr_schedule[step], step)

        if is_main and ((epoch + 1) % args.save_freq == 0 or epoch + 1 == args.epochs):
            state = {
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(),
                "epoch": epoch + 1,
                "args": vars(args),
            }
            torch.save(state, os.path.join(args.output_dir, "checkpoint.pth"))
            backbone = model.module.online_encoder[0].state_dict()
            torch.save(backbone, os.path.join(args.output_dir, f"backbone_ep{epoch + 1:04d}.pth"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
