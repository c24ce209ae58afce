"""Large-batch ImageNet training with LAMB (apex FusedLAMB), ResNet-50.

Reproduces the batch-size sweep (4k .. 32k) of the LAMB paper's ResNet-50 table;
the learning rate follows sqrt scaling from the 4k reference point.

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29400 \
        lamb_large_batch.py --data /fsx/imagenet --out /fsx/runs/lamb_r50_bs16k --batch-size 512
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
from apex.optimizers import FusedLAMB
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, transforms

REF_BATCH = 4096
REF_LR = 0.01


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch-size", type=int, default=512, help="per-GPU batch size")
    parser.add_argument("--epochs", type=int, default=90)
    parser.add_argument("--warmup-epochs", type=float, default=12.5)
    parser.add_argument("--wd", type=float, default=0.01)
    parser.add_argument("--label-smoothing", type=float, default=0.1)
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--amp", action="store_true")
    args = parser.parse_args()

    args.world_size = dist.get_world_size()
    args.global_batch = args.batch_size * args.world_size
    args.lr = REF_LR * math.sqrt(args.global_batch / REF_BATCH)
    return args


def loaders(args):
    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train = datasets.ImageFolder(os.path.join(args.data, "train"), transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.08, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        normalize,
    ]))
    val = datasets.ImageFolder(os.path.join(args.data, "val"), transforms.Compose([
        transforms.Resize(256),
        transforms.CenterCrop(224),
        transforms.ToTensor(),
        normalize,
    ]))
    train_sampler = DistributedSampler(train, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val, shuffle=False)
    train_loader = DataLoader(train, batch_size=args.batch_size, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True, prefetch_factor=4)
    val_loader = DataLoader(val, batch_size=256, sampler=val_sampler, num_workers=args.workers, pin_memory=True)
    return train_loader, val_loader, train_sampler


def lr_for_step(step, args, steps_per_epoch):
    warmup = int(args.warmup_epochs * steps_per_epoch)
    total = args.epochs * steps_per_epoch
    if step < warmup:
        return args.lr * step / warmup
    return args.lr * (1 - (step - warmup) / (total - warmup)) ** 2


def no_weight_decay_groups(model, wd):
    bn_bias, rest = [], []
    for name, p in model.named_parameters():
        (bn_bias if p.ndim == 1 else rest).append(p)
    return [{"params": rest, "weight_decay": wd}, {"params": bn_bias, "weight_decay": 0.0}]


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    counts = torch.zeros(2, device=device, dtype=torch.float64)
    for images, target in loader:
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=True):
            logits = model(images)
        counts[0] += (logits.argmax(1) == target).sum()
        counts[1] += target.numel()
    dist.all_reduce(counts)
    return 100.0 * (counts[0] / counts[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    train_loader, val_loader, train_sampler = loaders(args)
    steps_per_epoch = len(train_loader)

    model = torchvision.models.resnet50(zero_init_residual=True)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], bucket_cap_mb=50)

    optimizer = FusedLAMB(no_weight_decay_groups(model.module, args.wd), lr=args.lr,
                          betas=(0.9, 0.999), eps=1e-6, max_grad_norm=1.0)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)

    writer = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        writer = SummaryWriter(args.out)
        print(f"world {args.world_size} global batch {args.global_batch} peak lr {args.lr:.4f}", flush=True)

    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t_epoch = time.time()
        for images, target in train_loader:
            lr = lr_for_step(step, args, steps_per_epoch)
            for g in optimizer.param_groups:
                g["lr"] = lr
            images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                loss = criterion(model(images), target)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            step += 1
            if writer is not None and step % 20 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/lr", lr, step)

        top1 = validate(model, val_loader, device)
        if rank == 0:
            elapsed = time.time() - t_epoch
            print(f"epoch {epoch} top1 {top1:.2f} ({elapsed:.0f}s, "
                  f"{steps_per_epoch * args.global_batch / elapsed:.0f} img/s)", flush=True)
            writer.add_scalar("val/top1", top1, epoch)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch, "step": step},
                       os.path.join(args.out, "checkpoint.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
