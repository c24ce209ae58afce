"""Base-classifier training for randomized smoothing with a noise curriculum.

The Gaussian noise level is ramped linearly from --sigma-start to --sigma over
the first --ramp-epochs epochs (large sigma from scratch trains slowly on
ImageNet-scale data), then kept at --sigma. Noise is added inside the model so
the same module can be reused by the certification code.

    torchrun --nproc_per_node=8 11_noise_anneal_smoothing.py --data /datasets/imagenet \
        --sigma 1.0 --sigma-start 0.25 --ramp-epochs 20 --out runs/rs_imagenet_s100
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]


class NoisyClassifier(nn.Module):
    """normalise -> backbone, with isotropic Gaussian noise added in pixel space
    during training."""

    def __init__(self, backbone, sigma):
        super().__init__()
        self.backbone = backbone
        self.sigma = sigma
        self.register_buffer("mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1))

    def forward(self, x):
        if self.training and self.sigma > 0:
            x = x + torch.randn_like(x) * self.sigma
        return self.backbone((x - self.mean) / self.std)


def sigma_at(epoch, args):
    if epoch >= args.ramp_epochs:
        return args.sigma
    frac = epoch / max(args.ramp_epochs, 1)
    return args.sigma_start + frac * (args.sigma - args.sigma_start)


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--sigma", type=float, default=0.5)
    p.add_argument("--sigma-start", type=float, default=0.0)
    p.add_argument("--ramp-epochs", type=int, default=0)
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--lr", type=float, default=0.1, help="for a total batch of 256")
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--workers", type=int, default=12)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--log-interval", type=int, default=200)
    return p.parse_args()


@torch.no_grad()
def noisy_top1(model, loader, sigma, device):
    """accuracy of the base classifier under N(0, sigma^2) noise (a proxy for
    the smoothed classifier's clean accuracy)."""
    model.eval()
    c = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        x = x + torch.randn_like(x) * sigma
        c[0] += (model(x).argmax(1) == y).sum()
        c[1] += y.numel()
    dist.all_reduce(c)
    return (c[0] / c[1]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0
    if is_main:
        os.makedirs(args.out, exist_ok=True)

    train_tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor()])
    val_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor()])
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    train_sampler = DistributedSampler(train_set)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=100, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    backbone = getattr(torchvision.models, args.arch)(weights=None)
    model = NoisyClassifier(backbone, sigma=args.sigma).to(device)
    model = DDP(model, device_ids=[local_rank])

    total_batch = args.batch_size * world
    lr = args.lr * total_batch / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=args.wd)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30, gamma=0.1)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        sigma = sigma_at(epoch, args)
        model.sigma = sigma
        model.train()
        tic = time.time()
        meter = torch.zeros(3, device=device)
        for it, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                out = model(x)
                loss = F.cross_entropy(out, y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            meter[0] += loss.detach().float() * y.numel()
            meter[1] += (out.argmax(1) == y).sum()
            meter[2] += y.numel()
            if is_main and it % args.log_interval == 0:
                print(f"ep {epoch} it {it}/{len(train_loader)} sigma {sigma:.3f} "
                      f"loss {loss.item():.3f}", flush=True)
        scheduler.step()
        dist.all_reduce(meter)

        val_acc = noisy_top1(model, val_loader, args.sigma, device)
        if is_main:
            print(f"== epoch {epoch}: sigma {sigma:.3f}, train loss {(meter[0] / meter[2]).item():.4f}, "
                  f"train acc {(meter[1] / meter[2]).item():.4f}, val noisy acc (sigma={args.sigma}) "
                  f"{val_acc:.4f}, {time.time() - tic:.0f}s", flush=True)
            torch.save({"epoch": epoch + 1, "arch": args.arch, "sigma": args.sigma,
                        "state_dict": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
                       os.path.join(args.out, "checkpoint.pth.tar"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
