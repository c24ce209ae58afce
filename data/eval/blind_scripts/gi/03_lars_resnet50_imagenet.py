#!/usr/bin/env python
# ResNet-50 / ImageNet with LARS, large-batch recipe (You et al. 2017, Goyal et al. 2017).
#
#   torchrun --standalone --nproc_per_node=8 03_lars_resnet50_imagenet.py \
#       --data /mnt/imagenet --batch-size 256 --epochs 90

import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision.datasets as datasets
import torchvision.models as models
import torchvision.transforms as transforms
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


class LARS(torch.optim.Optimizer):
    """SGD with momentum and layer-wise trust ratio. Biases and BN params are
    put in a group with `lars_exclude=True` and get plain SGD."""

    def __init__(self, params, lr, momentum=0.9, weight_decay=0.0, eta=0.001, eps=1e-9):
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta, eps=eps,
                        lars_exclude=False)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                d_p = p.grad
                if not group["lars_exclude"]:
                    d_p = d_p.add(p, alpha=group["weight_decay"])
                    p_norm = torch.norm(p)
                    g_norm = torch.norm(d_p)
                    trust = torch.where(
                        (p_norm > 0) & (g_norm > 0),
                        group["eta"] * p_norm / (g_norm + group["eps"]),
                        torch.ones_like(p_norm),
                    )
                    d_p = d_p.mul(trust)
                state = self.state[p]
                if "mu" not in state:
                    state["mu"] = torch.clone(d_p).detach()
                else:
                    state["mu"].mul_(group["momentum"]).add_(d_p)
                p.add_(state["mu"], alpha=-group["lr"])


def param_groups(model, weight_decay):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.ndim == 1:
            no_decay.append(p)
        else:
            decay.append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0, "lars_exclude": True},
    ]


class AverageMeter:
    def __init__(self):
        self.sum, self.count = 0.0, 0

    def update(self, val, n=1):
        self.sum += val * n
        self.count += n

    @property
    def avg(self):
        return self.sum / max(self.count, 1)


def accuracy(output, target, topk=(1, 5)):
    maxk = max(topk)
    _, pred = output.topk(maxk, 1, True, True)
    correct = pred.t().eq(target.view(1, -1))
    return [correct[:k].reshape(-1).float().sum() for k in topk]


def validate(model, loader, device):
    model.eval()
    totals = torch.zeros(3, device=device)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        for images, target in loader:
            images = images.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            c1, c5 = accuracy(model(images), target)
            totals += torch.stack([c1, c5, torch.tensor(float(target.numel()), device=device)])
    dist.all_reduce(totals)
    return (100 * totals[0] / totals[2]).item(), (100 * totals[1] / totals[2]).item()


def main():
    parser = argparse.ArgumentParser(description="ResNet-50 LARS")
    parser.add_argument("--data", required=True)
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--epochs", type=int, default=90)
    parser.add_argument("--warmup-epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=256, help="images per GPU")
    parser.add_argument("--base-lr", type=float, default=0.2, help="lr per 256 images")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--wd", type=float, default=5e-5)
    parser.add_argument("--eta", type=float, default=0.001)
    parser.add_argument("--label-smoothing", type=float, default=0.1)
    parser.add_argument("--workers", type=int, default=10)
    parser.add_argument("--output", default="./output/lars_r50")
    parser.add_argument("--resume", default="")
    args = parser.parse_args()

    dist.init_process_group(backend="nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    rank, world_size = dist.get_rank(), dist.get_world_size()

    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), transforms.Compose([
        transforms.RandomResizedCrop(224),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        normalize,
    ]))
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), transforms.Compose([
        transforms.Resize(256),
        transforms.CenterCrop(224),
        transforms.ToTensor(),
        normalize,
    ]))
    train_sampler = DistributedSampler(train_set, shuffle=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    model = models.__dict__[args.arch]()
    # zero-init the last BN gamma of each residual block
    for m in model.modules():
        if isinstance(m, models.resnet.Bottleneck):
            nn.init.zeros_(m.bn3.weight)
    model = model.to(device).to(memory_format=torch.channels_last)
    model = DDP(model, device_ids=[local_rank])

    lr = args.base_lr * args.batch_size / 256
    optimizer = LARS(param_groups(model.module, args.wd), lr=lr, momentum=args.momentum, eta=args.eta)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing).to(device)

    steps_per_epoch = len(train_loader)
    warmup_steps = args.warmup_epochs * steps_per_epoch
    total_steps = args.epochs * steps_per_epoch

    def lr_at(step):
        if step < warmup_steps:
            return lr * (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return lr * (1 - progress) ** 2  # polynomial decay as in the LARS paper

    start_epoch, best_top1 = 0, 0.0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch, best_top1 = ckpt["epoch"] + 1, ckpt["best_top1"]

    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        print(f"world {world_size} | per-gpu batch {args.batch_size} | peak lr {lr:.3f} | "
              f"{steps_per_epoch} steps/epoch")

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        loss_meter = AverageMeter()
        t0 = time.time()
        for i, (images, target) in enumerate(train_loader):
            step = epoch * steps_per_epoch + i
            for g in optimizer.param_groups:
                g["lr"] = lr_at(step)
            images = images.to(device, non_blocking=True).to(memory_format=torch.channels_last)
            target = target.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(images), target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_meter.update(loss.item(), images.size(0))
            if rank == 0 and i % 100 == 0:
                print(f"ep {epoch} it {i}/{steps_per_epoch} loss {loss_meter.avg:.4f} "
                      f"lr {optimizer.param_groups[0]['lr']:.4f}")

        top1, top5 = validate(model, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} top1 {top1:.2f} top5 {top5:.2f} time {time.time() - t0:.0f}s")
            is_best = top1 > best_top1
            best_top1 = max(top1, best_top1)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "epoch": epoch, "best_top1": best_top1}
            torch.save(state, os.path.join(args.output, "last.pt"))
            if is_best:
                torch.save(state, os.path.join(args.output, "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
