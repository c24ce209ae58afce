#!/usr/bin/env python3
"""RegNetY-3.2GF / LARS with SyncBN, tuned on a minival split held out from train.

Small per-GPU batches on the 16-GPU partition, so BN is synchronised across ranks.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        11_regnet_lars_syncbn_minival.py --data /fsx/imagenet --out /fsx/runs/regnety4_lars
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Sampler, Subset
from torch.utils.data.distributed import DistributedSampler

from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy
from timm.utils import ModelEmaV2


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--lr-per-256", type=float, default=0.2)
    p.add_argument("--wd", type=float, default=5e-5)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--minival", type=int, default=25000)
    p.add_argument("--split-seed", type=int, default=2024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-sync-bn", action="store_true")
    p.add_argument("--ema-decay", type=float, default=0.9998)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


class ShardSampler(Sampler):
    """rank::world slicing for eval; no padding so every image is counted once."""

    def __init__(self, n, rank, world):
        self.indices = list(range(rank, n, world))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


class LARS(torch.optim.SGD):
    """SGD with layer-wise trust ratio on params that carry weight decay."""

    def __init__(self, params, lr, momentum=0.9, eta=0.001):
        super().__init__(params, lr=lr, momentum=momentum)
        self.eta = eta

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            if g["weight_decay"] == 0:
                continue
            for p in g["params"]:
                if p.grad is None:
                    continue
                p.grad.add_(p, alpha=g["weight_decay"])
                w, d = p.norm(), p.grad.norm()
                p.grad.mul_(torch.where((w > 0) & (d > 0), self.eta * w / d, torch.ones_like(w)))
        wds = [g["weight_decay"] for g in self.param_groups]
        for g in self.param_groups:
            g["weight_decay"] = 0.0  # already applied above
        try:
            return super().step(closure)
        finally:
            for g, wd in zip(self.param_groups, wds):
                g["weight_decay"] = wd


def build_data(args, rank, world):
    norm = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    train_tf = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(),
                          T.TrivialAugmentWide(), T.ToTensor(), norm])
    eval_tf = T.Compose([T.Resize(232), T.CenterCrop(224), T.ToTensor(), norm])
    root = os.path.join(args.data, "train")
    train_full = torchvision.datasets.ImageFolder(root, train_tf)
    eval_full = torchvision.datasets.ImageFolder(root, eval_tf)

    # same permutation on every rank regardless of the per-rank seed
    g = torch.Generator().manual_seed(args.split_seed)
    perm = torch.randperm(len(train_full), generator=g).tolist()
    train_set = Subset(train_full, perm[args.minival:])
    minival_set = Subset(eval_full, perm[:args.minival])

    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(minival_set, batch_size=128,
                            sampler=ShardSampler(len(minival_set), rank, world),
                            num_workers=args.workers, pin_memory=True)
    return train_loader, val_loader, train_sampler


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    s = torch.zeros(2, device=device)
    for x, y in loader:
        x = x.to(device, non_blocking=True, memory_format=torch.channels_last)
        y = y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            out = net(x)
        s[0] += (out.argmax(1) == y).sum()
        s[1] += y.numel()
    dist.all_reduce(s)
    return (100 * s[0] / s[1]).item()


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    # per-rank seed: loader workers draw different augmentations on each rank
    torch.manual_seed(args.seed + rank)

    train_loader, val_loader, train_sampler = build_data(args, rank, world)

    model = torchvision.models.regnet_y_3_2gf()
    if not args.no_sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device, memory_format=torch.channels_last)
    model = DDP(model, device_ids=[local_rank])
    ema = ModelEmaV2(model.module, decay=args.ema_decay)

    peak_lr = args.lr_per_256 * args.batch_size * world / 256
    wd_params = [p for p in model.parameters() if p.ndim > 1]
    other = [p for p in model.parameters() if p.ndim <= 1]
    optimizer = LARS([{"params": wd_params, "weight_decay": args.wd},
                      {"params": other, "weight_decay": 0.0}], lr=peak_lr)
    scaler = torch.cuda.amp.GradScaler()
    mixup = Mixup(mixup_alpha=0.2, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=1000)
    criterion = SoftTargetCrossEntropy()

    steps = len(train_loader)
    total, warm = steps * args.epochs, steps * args.warmup_epochs
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"train {len(train_loader.dataset)} minival {len(val_loader.dataset)} "
              f"global batch {args.batch_size * world} lr {peak_lr:.3f}", flush=True)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_loader):
            step = epoch * steps + i
            lr = peak_lr * step / warm if step < warm else \
                0.5 * peak_lr * (1 + math.cos(math.pi * (step - warm) / (total - warm)))
            for g in optimizer.param_groups:
                g["lr"] = lr
            x = x.to(device, non_blocking=True, memory_format=torch.channels_last)
            y = y.to(device, non_blocking=True)
            x, y = mixup(x, y)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            ema.update(model.module)
            if rank == 0 and i % 200 == 0:
                print(f"{epoch}:{i}/{steps} loss {loss.item():.3f} lr {lr:.3f} "
                      f"{(i + 1) * args.batch_size * world / (time.time() - t0):.0f} img/s",
                      flush=True)

        acc = evaluate(model, val_loader, device)
        acc_ema = evaluate(ema.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} minival {acc:.2f} ema {acc_ema:.2f}", flush=True)
            state = {"epoch": epoch, "model": model.module.state_dict(),
                     "ema": ema.module.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if acc_ema > best:
                best = acc_ema
                torch.save(state, os.path.join(args.out, "best_ema.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
