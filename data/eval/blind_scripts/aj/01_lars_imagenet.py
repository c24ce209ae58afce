#!/usr/bin/env python
"""Large-batch ImageNet training of ResNet-50 with LARS.

Follows the recipe of You et al. (2017) / Goyal et al. (2017): linear lr scaling
with the global batch, 5 epochs of warmup, then polynomial decay.

    torchrun --nproc_per_node=8 01_lars_imagenet.py --data /datasets/imagenet \
        --batch-size 256 --base-lr 0.2 --epochs 90
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
from torch.utils.tensorboard import SummaryWriter
import torchvision
import torchvision.transforms as T


class LARS(torch.optim.Optimizer):
    """Layer-wise adaptive rate scaling on top of SGD with momentum.

    Biases and BatchNorm parameters are excluded from adaptation and weight decay
    (the usual "lars_exclude" trick).
    """

    def __init__(self, params, lr, momentum=0.9, weight_decay=1e-4, eta=0.001):
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                        eta=eta, lars_exclude=False)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
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
                        group["eta"] * p_norm / g_norm,
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
        if p.ndim <= 1:
            no_decay.append(p)
        else:
            decay.append(p)
    return [
        {"params": decay, "weight_decay": weight_decay, "lars_exclude": False},
        {"params": no_decay, "weight_decay": 0.0, "lars_exclude": True},
    ]


def lr_at(step, total_steps, warmup_steps, peak_lr):
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return peak_lr * (1.0 - progress) ** 2


def build_loaders(args, rank, world_size):
    normalize = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_tf = T.Compose([
        T.RandomResizedCrop(224),
        T.RandomHorizontalFlip(),
        T.ToTensor(),
        normalize,
    ])
    val_tf = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), normalize])

    train_set = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = torchvision.datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)

    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank,
                                       shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    # strided shard of the validation set, no padding so every image counts once
    val_shard = Subset(val_set, list(range(rank, len(val_set), world_size)))
    val_loader = DataLoader(val_shard, batch_size=args.batch_size, shuffle=False,
                            num_workers=args.workers, pin_memory=True)
    return train_loader, val_loader, train_sampler


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # loss sum, top1, count
    for images, target in loader:
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(images)
        stats[0] += F.cross_entropy(out.float(), target, reduction="sum")
        stats[1] += (out.argmax(1) == target).sum()
        stats[2] += target.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item(), (100.0 * stats[1] / stats[2]).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--epochs", type=int, default=90)
    parser.add_argument("--warmup-epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=256, help="per GPU")
    parser.add_argument("--base-lr", type=float, default=0.2, help="lr for a global batch of 256")
    parser.add_argument("--weight-decay", type=float, default=5e-5)
    parser.add_argument("--label-smoothing", type=float, default=0.1)
    parser.add_argument("--workers", type=int, default=10)
    parser.add_argument("--output", default="runs/lars_r50")
    parser.add_argument("--resume", default="")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    train_loader, val_loader, train_sampler = build_loaders(args, rank, world_size)

    model = torchvision.models.__dict__[args.arch](num_classes=1000)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    global_batch = args.batch_size * world_size
    peak_lr = args.base_lr * global_batch / 256
    optimizer = LARS(param_groups(model.module, args.weight_decay), lr=peak_lr)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)

    steps_per_epoch = len(train_loader)
    total_steps = args.epochs * steps_per_epoch
    warmup_steps = args.warmup_epochs * steps_per_epoch

    start_epoch, best_acc = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch, best_acc = ckpt["epoch"] + 1, ckpt["best_acc"]

    writer = None
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        writer = SummaryWriter(args.output)
        print(f"world={world_size} global_batch={global_batch} peak_lr={peak_lr:.3f}")

    for epoch in range(start_epoch, args.epochs):
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for i, (images, target) in enumerate(train_loader):
            step = epoch * steps_per_epoch + i
            lr = lr_at(step, total_steps, warmup_steps, peak_lr)
            for g in optimizer.param_groups:
                g["lr"] = lr

            images = images.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(images), target)

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

            running[0] += loss.detach()
            running[1] += 1
            if i % 100 == 0 and rank == 0:
                print(f"ep {epoch} it {i}/{steps_per_epoch} loss {loss.item():.4f} lr {lr:.4f}")

        dist.all_reduce(running)
        train_loss = (running[0] / running[1]).item()
        val_loss, val_acc = evaluate(model.module, val_loader, device)

        if rank == 0:
            writer.add_scalar("train/loss", train_loss, epoch)
            writer.add_scalar("val/loss", val_loss, epoch)
            writer.add_scalar("val/top1", val_acc, epoch)
            print(f"epoch {epoch} train {train_loss:.4f} val {val_loss:.4f} top1 {val_acc:.2f} "
                  f"({time.time() - t0:.0f}s)")
            best_acc = max(best_acc, val_acc)
            state = {
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "epoch": epoch,
                "best_acc": best_acc,
                "args": vars(args),
            }
            torch.save(state, os.path.join(args.output, "checkpoint.pth"))
            if val_acc >= best_acc:
                torch.save(state, os.path.join(args.output, "best.pth"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
