#!/usr/bin/env python
"""Swin-T scene classification (NWPU-RESISC45) on Ascend 910B with resumable checkpoints.

Jobs on the shared Atlas 800T cluster are preempted, so training restarts from
the latest checkpoint:

    source /usr/local/Ascend/ascend-toolkit/set_env.sh
    torchrun --nproc_per_node=8 11_npu_swin_resisc45.py --data /mnt/sfs/resisc45 \
        --work-dir /mnt/sfs/work/swin_resisc45 --resume /mnt/sfs/work/swin_resisc45/latest.pth
"""
import argparse
import os
import time

import torch
import torch_npu  # noqa: F401
from torch_npu.npu import amp
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

import timm
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("--resume", default="")
    ap.add_argument("--arch", default="swin_tiny_patch4_window7_224")
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=5e-4, help="lr at global batch 512")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--mixup", type=float, default=0.8)
    ap.add_argument("--cutmix", type=float, default=1.0)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--save-every", type=int, default=1)
    return ap.parse_args()


def loaders(args, rank, world):
    mean, std = (0.368, 0.381, 0.344), (0.203, 0.185, 0.184)
    tr = transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.5, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.RandomVerticalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    te = transforms.Compose([transforms.Resize(224), transforms.ToTensor(), transforms.Normalize(mean, std)])
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), tr)
    test_set = datasets.ImageFolder(os.path.join(args.data, "test"), te)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)), 128,
                             num_workers=args.workers, pin_memory=True)
    return train_loader, test_loader, sampler, len(train_set.classes)


def warmup_cosine(optimizer, warmup_iters, total_iters):
    warm = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1e-3, total_iters=warmup_iters)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_iters - warmup_iters, eta_min=1e-6)
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [warm, cos], milestones=[warmup_iters])


@torch.no_grad()
def test(model, loader, device):
    model.eval()
    hit = torch.zeros((), device=device)
    cnt = torch.zeros((), device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with amp.autocast():
            hit += (model(x).argmax(-1) == y).sum()
        cnt += y.numel()
    dist.all_reduce(hit)
    dist.all_reduce(cnt)
    return (hit / cnt).item()


def save_checkpoint(path, model, optimizer, scheduler, scaler, epoch, best):
    tmp = path + ".tmp"
    torch.save({
        "model": model.module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
        "epoch": epoch,
        "best": best,
    }, tmp)
    os.replace(tmp, path)


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.npu.set_device(local_rank)
    dist.init_process_group("hccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"npu:{local_rank}")

    train_loader, test_loader, sampler, num_classes = loaders(args, rank, world)
    model = timm.create_model(args.arch, pretrained=True, num_classes=num_classes, drop_path_rate=0.2).to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.lr * args.batch_size * world / 512
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    iters = len(train_loader)
    scheduler = warmup_cosine(optimizer, args.warmup * iters, args.epochs * iters)
    scaler = amp.GradScaler()
    mixup = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=0.1, num_classes=num_classes)
    criterion = SoftTargetCrossEntropy()

    start_epoch, best = 0, 0.0
    if args.resume and os.path.exists(args.resume):
        ckpt = torch.load(args.resume)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]
        if rank == 0:
            print(f"resumed from {args.resume}, epoch {start_epoch}, best {best:.4f}", flush=True)

    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x, y_soft = mixup(x, y)
            with amp.autocast():
                loss = criterion(model(x), y_soft)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if rank == 0 and i % 20 == 0:
                print(f"[{epoch}][{i}/{iters}] loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.2e}",
                      flush=True)

        acc = test(model.module, test_loader, device)
        if rank == 0:
            print(f"epoch {epoch} acc {acc:.4f} time {time.time() - t0:.0f}s", flush=True)
            if acc > best:
                best = acc
                torch.save(model.module.state_dict(), os.path.join(args.work_dir, "best.pth"))
            if (epoch + 1) % args.save_every == 0:
                save_checkpoint(os.path.join(args.work_dir, "latest.pth"), model, optimizer, scheduler,
                                scaler, epoch, best)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
