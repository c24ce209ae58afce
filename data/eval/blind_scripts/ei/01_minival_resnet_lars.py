#!/usr/bin/env python3
"""ResNet-50 + LARS large-batch sweep runner with a held-out minival split.

Minival (10k images carved out of ImageNet train) is what the sweep tunes on,
so the official val set is only touched for the final number.

    torchrun --nproc_per_node=8 01_minival_resnet_lars.py --data /datasets/imagenet
"""
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def get_args():
    p = argparse.ArgumentParser(description="LARS minival sweep")
    p.add_argument("--data", default="/datasets/imagenet")
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--epochs", type=int, default=35)
    p.add_argument("--batch-size", type=int, default=256, help="per GPU")
    p.add_argument("--base-lr", type=float, default=0.3, help="lr per 256 images")
    p.add_argument("--warmup-epochs", type=float, default=5.0)
    p.add_argument("--weight-decay", type=float, default=1e-6)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--minival-size", type=int, default=10000)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="/checkpoint/lars_sweep/run0")
    p.add_argument("--log-every", type=int, default=50)
    return p.parse_args()


class LARS(torch.optim.Optimizer):
    """LARS without adaptation / weight decay for 1-d params (bias, BN)."""

    def __init__(self, params, lr=0.0, weight_decay=0.0, momentum=0.9, trust_coefficient=0.001):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum,
                        trust_coefficient=trust_coefficient)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                dp = p.grad
                if dp is None:
                    continue
                if p.ndim > 1:
                    dp = dp.add(p, alpha=g["weight_decay"])
                    param_norm = torch.norm(p)
                    update_norm = torch.norm(dp)
                    one = torch.ones_like(param_norm)
                    q = torch.where(param_norm > 0.0,
                                    torch.where(update_norm > 0,
                                                g["trust_coefficient"] * param_norm / update_norm, one),
                                    one)
                    dp = dp.mul(q)
                state = self.state[p]
                if "mu" not in state:
                    state["mu"] = torch.zeros_like(p)
                mu = state["mu"]
                mu.mul_(g["momentum"]).add_(dp)
                p.add_(mu, alpha=-g["lr"])


class WithTransform(Dataset):
    def __init__(self, base, indices, transform):
        self.base = base
        self.indices = indices
        self.transform = transform

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        path, target = self.base.samples[self.indices[i]]
        img = self.base.loader(path)
        return self.transform(img), target


def build_datasets(args):
    train_tf = T.Compose([
        T.RandomResizedCrop(224),
        T.RandomHorizontalFlip(),
        T.ToTensor(),
        T.Normalize(IMAGENET_MEAN, IMAGENET_STD),
    ])
    eval_tf = T.Compose([
        T.Resize(256),
        T.CenterCrop(224),
        T.ToTensor(),
        T.Normalize(IMAGENET_MEAN, IMAGENET_STD),
    ])
    base = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"))
    perm = torch.randperm(len(base)).tolist()
    minival_idx = perm[:args.minival_size]
    train_idx = perm[args.minival_size:]
    return WithTransform(base, train_idx, train_tf), WithTransform(base, minival_idx, eval_tf)


def lr_at(step, total_steps, warmup_steps, peak_lr):
    if step < warmup_steps:
        return peak_lr * step / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return peak_lr * 0.5 * (1.0 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # correct@1, correct@5, count
    for images, target in loader:
        images = images.to(device, non_blocking=True).to(memory_format=torch.channels_last)
        target = target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            output = model(images)
        top5 = output.topk(5, dim=1).indices
        stats[0] += (top5[:, 0] == target).sum()
        stats[1] += (top5 == target[:, None]).any(dim=1).sum()
        stats[2] += target.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item() * 100, (stats[1] / stats[2]).item() * 100


def main():
    args = get_args()
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    # different augmentation stream on every rank
    torch.manual_seed(args.seed + rank)
    torch.backends.cudnn.benchmark = True

    train_set, minival_set = build_datasets(args)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(minival_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(minival_set, batch_size=200, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    model = torchvision.models.__dict__[args.arch]()
    model = model.to(device, memory_format=torch.channels_last)
    model = DDP(model, device_ids=[local_rank])

    global_batch = args.batch_size * world_size
    peak_lr = args.base_lr * global_batch / 256
    optimizer = LARS(model.parameters(), lr=peak_lr, weight_decay=args.weight_decay)
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)

    steps_per_epoch = len(train_loader)
    total_steps = steps_per_epoch * args.epochs
    warmup_steps = int(args.warmup_epochs * steps_per_epoch)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world={world_size} global_batch={global_batch} peak_lr={peak_lr:.3f} "
              f"train={len(train_set)} minival={len(minival_set)}", flush=True)

    history = []
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.perf_counter()
        seen = 0
        for i, (images, target) in enumerate(train_loader):
            lr = lr_at(step, total_steps, warmup_steps, peak_lr)
            for g in optimizer.param_groups:
                g["lr"] = lr
            images = images.to(device, non_blocking=True).to(memory_format=torch.channels_last)
            target = target.to(device, non_blocking=True)

            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(model(images), target)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            step += 1
            seen += images.size(0)

            if rank == 0 and i % args.log_every == 0:
                torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                print(f"ep {epoch} it {i}/{steps_per_epoch} loss {loss.item():.4f} lr {lr:.4f} "
                      f"{seen * world_size / dt:.0f} img/s", flush=True)

        top1, top5 = evaluate(model, val_loader, device)
        history.append({"epoch": epoch, "top1": top1, "top5": top5})
        if rank == 0:
            print(f"epoch {epoch}: minival top1 {top1:.2f} top5 {top5:.2f}", flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()},
                       os.path.join(args.out, "last.pt"))
            with open(os.path.join(args.out, "history.json"), "w") as f:
                json.dump(history, f, indent=1)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
