#!/usr/bin/env python3
"""ResNet-101 / LAMB + EMA, long schedule split over several 24h allocations.

Each allocation runs --epochs-per-job epochs then exits; the next one is
started with --resume pointing at last.pth.

    torchrun --nproc_per_node=8 14_rn101_lamb_ema_resume.py --data /gpfs/imagenet \
        --out /gpfs/runs/rn101_lamb [--resume /gpfs/runs/rn101_lamb/last.pth]
"""
import argparse
import copy
import logging
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from timm.optim import Lamb

logger = logging.getLogger(__name__)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", default="")
    ap.add_argument("--epochs", type=int, default=600)
    ap.add_argument("--epochs-per-job", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=256, help="per GPU")
    ap.add_argument("--lr", type=float, default=8e-3, help="for a 2048 global batch")
    ap.add_argument("--wd", type=float, default=0.01)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--ema", type=float, default=0.9999)
    ap.add_argument("--ema-warmup", action="store_true")
    ap.add_argument("--workers", type=int, default=12)
    return ap.parse_args()


class EMA:
    def __init__(self, model, decay):
        self.shadow = copy.deepcopy(model).eval()
        for p in self.shadow.parameters():
            p.requires_grad_(False)
        self.decay = decay
        self.updates = 0

    @torch.no_grad()
    def update(self, model, warmup=False):
        self.updates += 1
        d = min(self.decay, (1 + self.updates) / (10 + self.updates)) if warmup else self.decay
        msd = model.state_dict()
        for k, v in self.shadow.state_dict().items():
            if v.dtype.is_floating_point:
                v.mul_(d).add_(msd[k].detach(), alpha=1 - d)
            else:
                v.copy_(msd[k])


def data(args):
    normalize = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    train = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "train"),
        T.Compose([T.RandomResizedCrop(224, interpolation=T.InterpolationMode.BICUBIC),
                   T.RandomHorizontalFlip(), T.RandAugment(2, 9), T.ToTensor(), normalize]))
    val = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "val"),
        T.Compose([T.Resize(256, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(224),
                   T.ToTensor(), normalize]))
    tsamp = DistributedSampler(train, drop_last=True)
    vsamp = DistributedSampler(val, shuffle=False)
    return (DataLoader(train, args.batch_size, sampler=tsamp, num_workers=args.workers,
                       pin_memory=True, drop_last=True, persistent_workers=True),
            DataLoader(val, 200, sampler=vsamp, num_workers=args.workers, pin_memory=True),
            tsamp)


@torch.no_grad()
def accuracy(model, loader, device):
    model.eval()
    c = torch.zeros(2, device=device)
    for x, y in loader:
        x = x.to(device, non_blocking=True).to(memory_format=torch.channels_last)
        y = y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(x)
        c += torch.stack([(out.argmax(1) == y).sum().float(), torch.tensor(float(y.numel()), device=device)])
    dist.all_reduce(c)
    return (100 * c[0] / c[1]).item()


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="[%(asctime)s] %(message)s")

    train_loader, val_loader, train_sampler = data(args)

    model = torchvision.models.resnet101()
    start_epoch = 0
    ckpt = None
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        start_epoch = ckpt["epoch"] + 1
        logger.info("resuming from %s (epoch %d)", args.resume, start_epoch)
    model = model.to(device, memory_format=torch.channels_last)
    ema = EMA(model, args.ema)
    if ckpt is not None:
        ema.shadow.load_state_dict(ckpt["ema"])
        ema.updates = ckpt["ema_updates"]
    model = DDP(model, device_ids=[local_rank])

    global_batch = args.batch_size * world
    peak_lr = args.lr * global_batch / 2048
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    optimizer = Lamb([{"params": decay, "weight_decay": args.wd},
                      {"params": no_decay, "weight_decay": 0.0}], lr=peak_lr)
    scaler = torch.cuda.amp.GradScaler()
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    spe = len(train_loader)
    total, warm = args.epochs * spe, args.warmup * spe
    end_epoch = min(args.epochs, start_epoch + args.epochs_per_job)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    logger.info("global batch %d, peak lr %.4g, epochs %d..%d", global_batch, peak_lr,
                start_epoch, end_epoch - 1)

    for epoch in range(start_epoch, end_epoch):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_loader):
            s = epoch * spe + i
            lr = peak_lr * (s + 1) / warm if s < warm else \
                peak_lr * 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm)))
            for g in optimizer.param_groups:
                g["lr"] = lr
            x = x.to(device, non_blocking=True).to(memory_format=torch.channels_last)
            y = y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            ema.update(model.module, warmup=args.ema_warmup)
            if i % 250 == 0:
                logger.info("ep %d it %d/%d loss %.4f lr %.3g  %.0f img/s", epoch, i, spe,
                            loss.item(), lr, (i + 1) * global_batch / (time.time() - t0))

        top1 = accuracy(model, val_loader, device)
        top1_ema = accuracy(ema.shadow, val_loader, device)
        logger.info("epoch %d top1 %.2f ema %.2f (%.0fs)", epoch, top1, top1_ema, time.time() - t0)
        if rank == 0:
            torch.save({"epoch": epoch, "model": model.state_dict(),
                        "ema": ema.shadow.state_dict(), "ema_updates": ema.updates,
                        "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
                        "top1": top1, "top1_ema": top1_ema},
                       os.path.join(args.out, "last.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
