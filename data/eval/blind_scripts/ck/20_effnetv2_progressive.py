"""EfficientNetV2-S with progressive learning (image size and regularisation grow by stage).

Stages (4 by default) linearly ramp train resolution 128 -> 300, RandAugment
magnitude 5 -> 15 and mixup alpha 0 -> 0.2, as in the EfficientNetV2 paper.

    torchrun --nproc_per_node=8 20_effnetv2_progressive.py --data /data/imagenet --out /ckpt/effv2s
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets

import timm
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import CosineLRScheduler
from timm.utils import ModelEmaV2


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/imagenet")
    ap.add_argument("--out", default="/ckpt/effv2s")
    ap.add_argument("--model", default="efficientnetv2_s")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=350)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--min-size", type=int, default=128)
    ap.add_argument("--max-size", type=int, default=300)
    ap.add_argument("--eval-size", type=int, default=384)
    ap.add_argument("--lr", type=float, default=1e-3, help="for global batch 1024")
    ap.add_argument("--wd", type=float, default=0.02)
    ap.add_argument("--warmup-epochs", type=int, default=5)
    ap.add_argument("--ema-decay", type=float, default=0.9999)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--resume", default="")
    return ap.parse_args()


def stage_params(stage, n_stages, args):
    t = stage / max(1, n_stages - 1)
    size = int(args.min_size + t * (args.max_size - args.min_size)) // 8 * 8
    magnitude = int(round(5 + t * 10))
    mixup_alpha = 0.2 * t
    return size, magnitude, mixup_alpha


def make_train_loader(root, size, magnitude, args, rank, world):
    tf = create_transform(size, is_training=True, auto_augment=f"rand-m{magnitude}-mstd0.5",
                          interpolation="bicubic", re_prob=0.0)
    ds = datasets.ImageFolder(root, tf)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)
    return loader, sampler


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    t = torch.zeros(2, device=device)
    for x, y in loader:
        x = x.to(device, non_blocking=True).to(memory_format=torch.channels_last)
        y = y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            t[0] += (model(x).argmax(1) == y).sum()
        t[1] += y.numel()
    dist.all_reduce(t)
    return (100 * t[0] / t[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(100 + rank)

    model = timm.create_model(args.model, num_classes=1000, drop_rate=0.2, drop_path_rate=0.2)
    start_epoch, best = 0, 0.0
    ckpt = None
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]
    model = model.to(device, memory_format=torch.channels_last)
    model = DDP(model, device_ids=[local_rank])
    ema = ModelEmaV2(model.module, decay=args.ema_decay)
    if ckpt is not None:
        ema.module.load_state_dict(ckpt["ema"])

    val_tf = create_transform(args.eval_size, is_training=False, crop_pct=1.0, interpolation="bicubic")
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=100,
                            num_workers=args.workers, pin_memory=True)

    lr = args.lr * args.batch_size * world / 1024
    optimizer = create_optimizer_v2(model.module, opt="adamw", lr=lr, weight_decay=args.wd)
    scheduler = CosineLRScheduler(optimizer, t_initial=args.epochs, lr_min=1e-6, warmup_t=args.warmup_epochs,
                                  warmup_lr_init=1e-6)
    scaler = torch.cuda.amp.GradScaler()
    criterion = SoftTargetCrossEntropy()
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    epochs_per_stage = args.epochs // args.stages
    current_stage, train_loader, sampler, mixup = None, None, None, None
    for epoch in range(start_epoch, args.epochs):
        stage = min(epoch // epochs_per_stage, args.stages - 1)
        if stage != current_stage:
            size, magnitude, mixup_alpha = stage_params(stage, args.stages, args)
            train_loader, sampler = make_train_loader(os.path.join(args.data, "train"), size, magnitude,
                                                      args, rank, world)
            # stage 0 has no mixup (prob=0) but still produces smoothed one-hot targets
            mixup = Mixup(mixup_alpha=max(mixup_alpha, 1e-3), cutmix_alpha=0.0, prob=float(mixup_alpha > 0),
                          label_smoothing=0.1, num_classes=1000)
            current_stage = stage
            if rank == 0:
                print(f"stage {stage}: size {size}, randaug m{magnitude}, mixup {mixup_alpha:.2f}")
        sampler.set_epoch(epoch)
        scheduler.step(epoch)
        model.train()
        t0 = time.time()
        for it, (x, y) in enumerate(train_loader):
            x = x.to(device, non_blocking=True).to(memory_format=torch.channels_last)
            y = y.to(device, non_blocking=True)
            x, y = mixup(x, y)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            ema.update(model.module)
            if rank == 0 and it % 200 == 0:
                print(f"epoch {epoch} it {it}/{len(train_loader)} loss {loss.item():.4f}", flush=True)

        acc = evaluate(model.module, val_loader, device)
        ema_acc = evaluate(ema.module, val_loader, device)
        best = max(best, ema_acc)
        if rank == 0:
            print(f"epoch {epoch}: top1 {acc:.2f} ema {ema_acc:.2f} best {best:.2f} ({time.time() - t0:.0f}s)")
            torch.save({"model": model.state_dict(), "ema": ema.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
                        "epoch": epoch, "best": best}, os.path.join(args.out, "last.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
