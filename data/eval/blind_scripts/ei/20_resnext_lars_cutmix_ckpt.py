"""ResNeXt-50 32x4d / LARS + CutMix, periodic checkpoints and best-model copy.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        20_resnext_lars_cutmix_ckpt.py --data /mnt/fsx/imagenet --ckpt-dir /mnt/fsx/ckpt/rx50_lars
"""
import argparse
import math
import os
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from timm.optim import Lars


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=256, help="per GPU")
    p.add_argument("--lr", type=float, default=0.25, help="per 256 images")
    p.add_argument("--wd", type=float, default=5e-5)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--cutmix-alpha", type=float, default=1.0)
    p.add_argument("--cutmix-prob", type=float, default=0.5)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--save-freq", type=int, default=10)
    p.add_argument("--resume", default="")
    return p.parse_args()


def rand_bbox(h, w, lam):
    cut = math.sqrt(1.0 - lam)
    ch, cw = int(h * cut), int(w * cut)
    cy, cx = np.random.randint(h), np.random.randint(w)
    y1, y2 = np.clip(cy - ch // 2, 0, h), np.clip(cy + ch // 2, 0, h)
    x1, x2 = np.clip(cx - cw // 2, 0, w), np.clip(cx + cw // 2, 0, w)
    return y1, y2, x1, x2


def cutmix(x, y, alpha):
    lam = np.random.beta(alpha, alpha)
    idx = torch.randperm(x.size(0), device=x.device)
    y1, y2, x1, x2 = rand_bbox(x.size(2), x.size(3), lam)
    x[:, :, y1:y2, x1:x2] = x[idx, :, y1:y2, x1:x2]
    lam = 1 - (y2 - y1) * (x2 - x1) / (x.size(2) * x.size(3))
    return x, y, y[idx], lam


def save_checkpoint(state, is_best, ckpt_dir, epoch, save_freq):
    path = os.path.join(ckpt_dir, "checkpoint.pth.tar")
    torch.save(state, path)
    if (epoch + 1) % save_freq == 0:
        shutil.copyfile(path, os.path.join(ckpt_dir, f"checkpoint_{epoch:03d}.pth.tar"))
    if is_best:
        shutil.copyfile(path, os.path.join(ckpt_dir, "model_best.pth.tar"))


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    c = torch.zeros(3, device=device)
    for x, y in loader:
        x = x.to(device, non_blocking=True, memory_format=torch.channels_last)
        y = y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
        top5 = out.topk(5, 1).indices
        c[0] += (top5[:, 0] == y).sum()
        c[1] += (top5 == y[:, None]).any(1).sum()
        c[2] += y.numel()
    dist.all_reduce(c)
    return (100 * c[0] / c[2]).item(), (100 * c[1] / c[2]).item()


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    norm = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    train_ds = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "train"),
        T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), norm]))
    val_ds = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "val"),
        T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm]))
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_ds, 250, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=args.workers, pin_memory=True)

    model = torchvision.models.resnext50_32x4d(zero_init_residual=True)
    model = model.to(device, memory_format=torch.channels_last)
    model = DDP(model, device_ids=[local_rank])

    peak = args.lr * args.batch_size * world / 256
    optimizer = Lars([{"params": [p for p in model.parameters() if p.ndim > 1],
                       "weight_decay": args.wd},
                      {"params": [p for p in model.parameters() if p.ndim <= 1],
                       "weight_decay": 0.0}],
                     lr=peak, momentum=0.9, trust_coeff=0.001)

    start_epoch, best_acc1 = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch, best_acc1 = ckpt["epoch"], ckpt["best_acc1"]

    spe = len(train_loader)
    total, warm = spe * args.epochs, spe * args.warmup_epochs
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        print(f"world {world} global batch {args.batch_size * world} peak lr {peak:.3f}",
              flush=True)
    dist.barrier()

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_loader):
            step = epoch * spe + i
            lr = peak * (step + 1) / warm if step < warm else \
                peak * 0.5 * (1 + math.cos(math.pi * (step - warm) / (total - warm)))
            for g in optimizer.param_groups:
                g["lr"] = lr
            x = x.to(device, non_blocking=True, memory_format=torch.channels_last)
            y = y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                if args.cutmix_alpha > 0 and np.random.rand() < args.cutmix_prob:
                    x, ya, yb, lam = cutmix(x, y, args.cutmix_alpha)
                    out = model(x)
                    loss = lam * F.cross_entropy(out, ya) + (1 - lam) * F.cross_entropy(out, yb)
                else:
                    loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if rank == 0 and i % 100 == 0:
                print(f"ep {epoch} {i}/{spe} loss {loss.item():.4f} lr {lr:.4f} "
                      f"{(i + 1) * args.batch_size * world / (time.time() - t0):.0f} img/s",
                      flush=True)

        acc1, acc5 = validate(model, val_loader, device)
        is_best = acc1 > best_acc1
        best_acc1 = max(acc1, best_acc1)
        if rank == 0:
            print(f"epoch {epoch}: acc@1 {acc1:.2f} acc@5 {acc5:.2f} best {best_acc1:.2f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
        save_checkpoint({"epoch": epoch + 1, "arch": "resnext50_32x4d",
                         "state_dict": model.module.state_dict(), "best_acc1": best_acc1,
                         "optimizer": optimizer.state_dict()},
                        is_best, args.ckpt_dir, epoch, args.save_freq)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
