"""ResNet-50, LARS, CutMix/MixUp, EMA - 16k-batch recipe reproduction.

Launch (2 nodes x 8 GPUs, per-GPU batch 1024 -> global 16384):
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \
        --rdzv_endpoint=$HEAD:29500 03_rn50_lars_cutmix_ema.py --data /fsx/imagenet
"""
import argparse
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
from torch.nn.parallel import DistributedDataParallel
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, default_collate
from torch.utils.data.distributed import DistributedSampler
from torchvision.transforms import v2

from timm.optim import Lars
from timm.scheduler import CosineLRScheduler

log = logging.getLogger("rn50_lars")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/fsx/imagenet")
    ap.add_argument("--output", default="/fsx/runs/rn50_lars_16k")
    ap.add_argument("--epochs", type=int, default=90)
    ap.add_argument("--batch-size", type=int, default=1024, help="per-GPU")
    ap.add_argument("--lr-per-256", type=float, default=0.29)
    ap.add_argument("--weight-decay", type=float, default=5e-5)
    ap.add_argument("--warmup-epochs", type=int, default=25)
    ap.add_argument("--mixup-alpha", type=float, default=0.2)
    ap.add_argument("--cutmix-alpha", type=float, default=1.0)
    ap.add_argument("--ema-decay", type=float, default=0.9999)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--log-interval", type=int, default=20)
    return ap.parse_args()


def build_loaders(args, num_classes=1000):
    train_tf = v2.Compose([
        v2.RandomResizedCrop(192, antialias=True),
        v2.RandomHorizontalFlip(),
        v2.PILToTensor(),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    ])
    val_tf = v2.Compose([
        v2.Resize(256, antialias=True),
        v2.CenterCrop(224),
        v2.PILToTensor(),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    ])
    train_ds = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_ds = torchvision.datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)

    mix = v2.RandomChoice([
        v2.MixUp(alpha=args.mixup_alpha, num_classes=num_classes),
        v2.CutMix(alpha=args.cutmix_alpha, num_classes=num_classes),
    ])

    def collate(batch):
        return mix(*default_collate(batch))

    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              collate_fn=collate, persistent_workers=True, prefetch_factor=4)
    val_loader = DataLoader(val_ds, batch_size=250, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)
    return train_loader, val_loader


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device)
    for x, y in loader:
        x = x.to(device, non_blocking=True, memory_format=torch.channels_last)
        y = y.to(device, non_blocking=True)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            logits = model(x)
        acc[0] += (logits.argmax(dim=1) == y).sum()
        acc[1] += y.numel()
    dist.all_reduce(acc, op=dist.ReduceOp.SUM)
    return 100.0 * (acc[0] / acc[1]).item()


def train_one_epoch(model, ema, loader, optimizer, scheduler, scaler, criterion, epoch, args, device):
    model.train()
    world = dist.get_world_size()
    n_iter = len(loader)
    start = time.perf_counter()
    for it, (x, y) in enumerate(loader):
        x = x.to(device, non_blocking=True, memory_format=torch.channels_last)
        y = y.to(device, non_blocking=True)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            loss = criterion(model(x), y)

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        ema.update_parameters(model.module)
        scheduler.step_update(epoch * n_iter + it + 1)

        if it % args.log_interval == 0 and dist.get_rank() == 0:
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            imgs = (it + 1) * args.batch_size * world
            log.info("epoch %d [%d/%d] loss %.4f lr %.4f  %.0f img/s", epoch, it, n_iter,
                     loss.item(), optimizer.param_groups[0]["lr"], imgs / elapsed)


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")
    torch.backends.cudnn.benchmark = True

    train_loader, val_loader = build_loaders(args)

    model = torchvision.models.resnet50(zero_init_residual=True)
    model.to(device, memory_format=torch.channels_last)
    model = DistributedDataParallel(model, device_ids=[local_rank])
    # after the wrap: DDP has broadcast rank 0's init, so every rank's EMA starts equal
    ema = AveragedModel(model.module, multi_avg_fn=get_ema_multi_avg_fn(args.ema_decay),
                        use_buffers=True)

    global_bs = args.batch_size * world
    lr = args.lr_per_256 * global_bs / 256
    decay, no_decay = [], []
    for n, p in model.module.named_parameters():
        (no_decay if p.ndim <= 1 else decay).append(p)
    optimizer = Lars([{"params": decay, "weight_decay": args.weight_decay},
                      {"params": no_decay, "weight_decay": 0.0}],
                     lr=lr, momentum=0.9, trust_coeff=0.001)
    n_iter = len(train_loader)
    scheduler = CosineLRScheduler(optimizer, t_initial=args.epochs * n_iter,
                                  warmup_t=args.warmup_epochs * n_iter, warmup_lr_init=1e-6,
                                  lr_min=1e-6, t_in_epochs=False)
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.CrossEntropyLoss()  # targets are soft after MixUp/CutMix

    log.info("global batch %d, lr %.3f, %d iters/epoch", global_bs, lr, n_iter)
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        train_one_epoch(model, ema, train_loader, optimizer, scheduler, scaler, criterion,
                        epoch, args, device)
        top1 = evaluate(model, val_loader, device)
        top1_ema = evaluate(ema.module, val_loader, device)
        log.info("epoch %d  top1 %.2f  ema top1 %.2f", epoch, top1, top1_ema)
        if rank == 0:
            state = {"epoch": epoch, "model": model.module.state_dict(),
                     "ema": ema.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scaler": scaler.state_dict(), "args": vars(args)}
            torch.save(state, os.path.join(args.output, "last.pth"))
            if max(top1, top1_ema) > best:
                best = max(top1, top1_ema)
                torch.save(state, os.path.join(args.output, "best.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
