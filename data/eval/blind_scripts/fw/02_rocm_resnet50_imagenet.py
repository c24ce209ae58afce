#!/usr/bin/env python
"""ResNet-50 ImageNet training on AMD Instinct MI250X (ROCm).

Each MI250X shows up as two GCDs, i.e. 8 HIP devices per node. On ROCm the
torch.cuda API maps to HIP and the "nccl" backend is RCCL.

    # on each of the 2 nodes
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \
        --rdzv_endpoint=$HEAD_NODE:29400 --rdzv_id=$SLURM_JOB_ID \
        02_rocm_resnet50_imagenet.py --data /lustre/datasets/imagenet \
        --out /lustre/$USER/runs/r50
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
import torchvision
from torchvision import transforms as T


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--batch-size", type=int, default=128, help="per device")
    p.add_argument("--base-lr", type=float, default=0.1, help="lr for a global batch of 256")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--resume", default="")
    p.add_argument("--print-freq", type=int, default=100)
    return p.parse_args()


def build_loaders(args, rank, world_size):
    normalize = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_tf = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), normalize])
    val_tf = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), normalize])

    train_set = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = torchvision.datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)

    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    train_loader = DataLoader(
        train_set, batch_size=args.batch_size, sampler=train_sampler,
        num_workers=args.workers, pin_memory=True, persistent_workers=True, drop_last=True,
    )
    # strided, unpadded shard of the validation set so every image is counted exactly once
    val_shard = Subset(val_set, range(rank, len(val_set), world_size))
    val_loader = DataLoader(val_shard, batch_size=args.batch_size, shuffle=False,
                            num_workers=args.workers, pin_memory=True)
    return train_loader, train_sampler, val_loader


def lr_at(epoch_float, args, peak_lr):
    if epoch_float < args.warmup_epochs:
        return peak_lr * epoch_float / args.warmup_epochs
    progress = (epoch_float - args.warmup_epochs) / (args.epochs - args.warmup_epochs)
    return 0.5 * peak_lr * (1 + torch.cos(torch.tensor(progress * torch.pi)).item())


@torch.no_grad()
def validate(model, loader, device, amp):
    model.eval()
    stats = torch.zeros(3, device=device, dtype=torch.float64)  # loss_sum, top1, count
    for images, target in loader:
        images = images.to(device, non_blocking=True).to(memory_format=torch.channels_last)
        target = target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
            logits = model(images)
        stats[0] += F.cross_entropy(logits.float(), target, reduction="sum")
        stats[1] += (logits.argmax(1) == target).sum()
        stats[2] += target.numel()
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[2]).item(), (100.0 * stats[1] / stats[2]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")  # RCCL under ROCm
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda")  # current device, set above
    is_main = rank == 0

    torch.backends.cudnn.benchmark = True  # MIOpen find-mode on ROCm

    train_loader, train_sampler, val_loader = build_loaders(args, rank, world_size)

    model = torchvision.models.__dict__[args.arch](num_classes=1000)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device, memory_format=torch.channels_last)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    global_batch = args.batch_size * world_size
    peak_lr = args.base_lr * global_batch / 256
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim <= 1 else decay).append(p)
    optimizer = torch.optim.SGD(
        [{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
        lr=peak_lr, momentum=args.momentum, nesterov=True,
    )
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)

    start_epoch, best_top1 = 0, 0.0
    ckpt_path = args.resume or os.path.join(args.out, "checkpoint.pt")
    if os.path.isfile(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=f"cuda:{local_rank}")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_top1 = ckpt["epoch"] + 1, ckpt["best_top1"]
        if is_main:
            print(f"resumed from {ckpt_path} at epoch {start_epoch}", flush=True)

    if is_main:
        os.makedirs(args.out, exist_ok=True)
        print(f"world={world_size} global_batch={global_batch} peak_lr={peak_lr:.3f}", flush=True)

    iters = len(train_loader)
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (images, target) in enumerate(train_loader):
            lr = lr_at(epoch + it / iters, args, peak_lr)
            for g in optimizer.param_groups:
                g["lr"] = lr
            images = images.to(device, non_blocking=True).to(memory_format=torch.channels_last)
            target = target.to(device, non_blocking=True)

            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                loss = criterion(model(images), target)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()

            if it % args.print_freq == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if is_main:
                    ips = (it + 1) * global_batch / (time.time() - t0)
                    print(f"ep {epoch} it {it}/{iters} loss {l.item():.4f} lr {lr:.4f} {ips:.0f} img/s", flush=True)

        val_loss, top1 = validate(model.module, val_loader, device, args.amp)
        if is_main:
            print(f"== epoch {epoch} val_loss {val_loss:.4f} top1 {top1:.2f} ({time.time() - t0:.0f}s)", flush=True)
            best_top1 = max(best_top1, top1)
            state = {
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(),
                "epoch": epoch,
                "best_top1": best_top1,
            }
            tmp = os.path.join(args.out, "checkpoint.pt.tmp")
            torch.save(state, tmp)
            os.replace(tmp, os.path.join(args.out, "checkpoint.pt"))
            if top1 >= best_top1:
                torch.save(state["model"], os.path.join(args.out, "best_model.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
