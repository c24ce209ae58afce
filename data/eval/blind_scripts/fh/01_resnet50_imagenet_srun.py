#!/usr/bin/env python
"""ResNet-50 ImageNet training on the GPU partition.

Submitted through jobs/resnet50.sbatch:

    #SBATCH --nodes=4
    #SBATCH --ntasks-per-node=4
    #SBATCH --gres=gpu:4
    #SBATCH --cpus-per-task=8
    #SBATCH --time=24:00:00

    export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    export MASTER_PORT=$((10000 + SLURM_JOB_ID % 50000))
    srun python train_resnet50.py --data /gpfs/datasets/imagenet \
        --out /gpfs/projects/vision/runs/r50_$SLURM_JOB_ID --amp

One process per GPU, rank information is taken from SLURM.
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
import torchvision
from torchvision import transforms


def parse_args():
    p = argparse.ArgumentParser(description="ResNet ImageNet (SLURM/DDP)")
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--batch-size", type=int, default=64, help="images per GPU")
    p.add_argument("--base-lr", type=float, default=0.1, help="lr for a global batch of 256")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--print-freq", type=int, default=100)
    p.add_argument("--amp", action="store_true")
    return p.parse_args()


def setup_distributed():
    rank = int(os.environ["SLURM_PROCID"])
    world_size = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://",
                            rank=rank, world_size=world_size)
    return rank, world_size, local_rank


def build_loaders(args, rank, world_size):
    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406],
                                     std=[0.229, 0.224, 0.225])
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        normalize,
    ])
    val_tf = transforms.Compose([
        transforms.Resize(256),
        transforms.CenterCrop(224),
        transforms.ToTensor(),
        normalize,
    ])
    train_set = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = torchvision.datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)

    workers = int(os.environ.get("SLURM_CPUS_PER_TASK", 8))
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank,
                                       shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    # strided shard of the validation set, no padding so every image is counted once
    val_shard = Subset(val_set, list(range(rank, len(val_set), world_size)))
    val_loader = DataLoader(val_shard, batch_size=128, shuffle=False,
                            num_workers=workers, pin_memory=True)
    return train_loader, val_loader, train_sampler


def lr_lambda_factory(args, steps_per_epoch):
    warmup = args.warmup_epochs * steps_per_epoch
    total = args.epochs * steps_per_epoch

    def fn(step):
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return fn


def train_one_epoch(model, loader, criterion, optimizer, scheduler, scaler, epoch, args, rank):
    model.train()
    t0 = time.time()
    for it, (images, target) in enumerate(loader):
        images = images.cuda(non_blocking=True)
        target = target.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
            output = model(images)
            loss = criterion(output, target)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()

        if it % args.print_freq == 0 and rank == 0:
            elapsed = time.time() - t0
            print(f"epoch {epoch} it {it}/{len(loader)} loss {loss.item():.4f} "
                  f"lr {scheduler.get_last_lr()[0]:.4f} {elapsed:.1f}s", flush=True)


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    stats = torch.zeros(3, device="cuda")
    for images, target in loader:
        images = images.cuda(non_blocking=True)
        target = target.cuda(non_blocking=True)
        output = model(images)
        _, pred = output.topk(5, dim=1)
        correct = pred.eq(target.view(-1, 1))
        stats[0] += correct[:, :1].sum()
        stats[1] += correct.sum()
        stats[2] += target.numel()
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    top1 = (stats[0] / stats[2]).item() * 100
    top5 = (stats[1] / stats[2]).item() * 100
    return top1, top5


def save_checkpoint(path, model, optimizer, scheduler, scaler, epoch, best_acc):
    tmp = path + ".tmp"
    torch.save({
        "model": model.module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
        "epoch": epoch,
        "best_acc": best_acc,
    }, tmp)
    os.replace(tmp, path)


def main():
    args = parse_args()
    rank, world_size, local_rank = setup_distributed()
    torch.backends.cudnn.benchmark = True

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world size {world_size}, per-GPU batch {args.batch_size}", flush=True)

    train_loader, val_loader, train_sampler = build_loaders(args, rank, world_size)

    model = torchvision.models.__dict__[args.arch](num_classes=1000).cuda()
    model = DDP(model, device_ids=[local_rank])

    global_batch = args.batch_size * world_size
    lr = args.base_lr * global_batch / 256
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim <= 1 else decay).append(p)
    optimizer = torch.optim.SGD([
        {"params": decay, "weight_decay": args.wd},
        {"params": no_decay, "weight_decay": 0.0},
    ], lr=lr, momentum=args.momentum, nesterov=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda_factory(args, len(train_loader)))
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing).cuda()

    ckpt_path = os.path.join(args.out, "last.pth")
    start_epoch, best_acc = 0, 0.0
    if os.path.isfile(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"] + 1
        best_acc = ckpt["best_acc"]
        if rank == 0:
            print(f"resumed from epoch {ckpt['epoch']}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        train_one_epoch(model, train_loader, criterion, optimizer, scheduler, scaler,
                        epoch, args, rank)
        top1, top5 = evaluate(model.module, val_loader)
        if rank == 0:
            print(f"epoch {epoch} val top1 {top1:.2f} top5 {top5:.2f}", flush=True)
            is_best = top1 > best_acc
            best_acc = max(best_acc, top1)
            save_checkpoint(ckpt_path, model, optimizer, scheduler, scaler, epoch, best_acc)
            if is_best:
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
