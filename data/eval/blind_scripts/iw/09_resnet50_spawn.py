#!/usr/bin/env python3
"""ResNet-50 "strikes back" (A2-style) ImageNet training, multiprocessing launcher.

Starts one process per local GPU with torch.multiprocessing.spawn; for several nodes
run the same command on each node with its --node-rank.

    python 09_resnet50_spawn.py --nnodes 1 --node-rank 0 --dist-url tcp://10.1.0.5:23456
"""
import argparse
import os
import shutil
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torchvision import datasets, models

from timm.data import Mixup, create_transform
from timm.loss import BinaryCrossEntropy
from timm.optim import Lamb
from timm.scheduler import CosineLRScheduler


def get_parser():
    p = argparse.ArgumentParser(description="ResNet-50 A2 recipe")
    p.add_argument("--data", default="/data/imagenet")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--dist-url", default="tcp://127.0.0.1:23456")
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=256, help="per GPU")
    p.add_argument("--lr", type=float, default=5e-3, help="for a global batch of 2048")
    p.add_argument("--wd", type=float, default=0.02)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--workers", type=int, default=12)
    p.add_argument("--resume", default="")
    p.add_argument("--ckpt-dir", default="/shared/ckpt/r50_a2")
    p.add_argument("--print-freq", type=int, default=100)
    return p


def main_worker(gpu, ngpus_per_node, args):
    rank = args.node_rank * ngpus_per_node + gpu
    world_size = args.nnodes * ngpus_per_node
    torch.cuda.set_device(gpu)
    dist.init_process_group(backend="nccl", init_method=args.dist_url,
                            world_size=world_size, rank=rank)
    is_main = rank == 0
    torch.backends.cudnn.benchmark = True

    model = models.resnet50(weights=None, zero_init_residual=True)
    # per-GPU batch is large enough for plain BN in the paper, but SyncBN keeps
    # statistics identical across ranks for EMA-free evaluation
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.cuda(gpu)
    model = DDP(model, device_ids=[gpu], output_device=gpu)

    global_batch = args.batch_size * world_size
    lr = args.lr * global_batch / 2048
    bn_bias = [p for n, p in model.named_parameters() if p.ndim <= 1]
    rest = [p for n, p in model.named_parameters() if p.ndim > 1]
    optimizer = Lamb([{"params": rest, "weight_decay": args.wd},
                      {"params": bn_bias, "weight_decay": 0.0}], lr=lr)
    criterion = BinaryCrossEntropy(target_threshold=0.2).cuda(gpu)

    train_tf = create_transform(224, is_training=True, auto_augment="rand-m7-mstd0.5-inc1",
                                interpolation="bicubic")
    val_tf = create_transform(224, is_training=False, crop_pct=0.95, interpolation="bicubic")
    train_ds = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_ds = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    train_sampler = torch.utils.data.distributed.DistributedSampler(train_ds, num_replicas=world_size,
                                                                    rank=rank, shuffle=True)
    val_shard = torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world_size))
    train_loader = torch.utils.data.DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                                               num_workers=args.workers, pin_memory=True, drop_last=True,
                                               persistent_workers=True)
    val_loader = torch.utils.data.DataLoader(val_shard, batch_size=256, shuffle=False,
                                             num_workers=args.workers, pin_memory=True)
    mixup = Mixup(mixup_alpha=0.1, cutmix_alpha=1.0, label_smoothing=0.0, num_classes=1000)

    iters = len(train_loader)
    scheduler = CosineLRScheduler(optimizer, t_initial=args.epochs * iters, warmup_t=args.warmup_epochs * iters,
                                  warmup_lr_init=1e-6, lr_min=1e-6, t_in_epochs=False)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch, best_acc1 = 0, 0.0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume, map_location=f"cuda:{gpu}")
        model.module.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_acc1 = ckpt["epoch"] + 1, ckpt["best_acc1"]
        if is_main:
            print(f"=> resumed '{args.resume}' (epoch {ckpt['epoch']})")
        del ckpt

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        train(train_loader, model, criterion, optimizer, scheduler, scaler, mixup, epoch, gpu, args, is_main)
        acc1 = validate(val_loader, model.module, gpu)

        is_best = acc1 > best_acc1
        best_acc1 = max(acc1, best_acc1)
        if is_main:
            print(f" * epoch {epoch} Acc@1 {acc1:.3f} (best {best_acc1:.3f})", flush=True)
            os.makedirs(args.ckpt_dir, exist_ok=True)
            path = os.path.join(args.ckpt_dir, "checkpoint.pth.tar")
            torch.save({"epoch": epoch, "state_dict": model.module.state_dict(), "best_acc1": best_acc1,
                        "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()}, path)
            if is_best:
                shutil.copyfile(path, os.path.join(args.ckpt_dir, "model_best.pth.tar"))

    dist.destroy_process_group()


def train(loader, model, criterion, optimizer, scheduler, scaler, mixup, epoch, gpu, args, is_main):
    model.train()
    iters = len(loader)
    end = time.time()
    for i, (images, target) in enumerate(loader):
        images = images.cuda(gpu, non_blocking=True)
        target = target.cuda(gpu, non_blocking=True)
        images, target = mixup(images, target)
        with torch.cuda.amp.autocast():
            output = model(images)
            loss = criterion(output, target)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step_update(epoch * iters + i + 1)
        if is_main and i % args.print_freq == 0:
            print(f"Epoch [{epoch}][{i}/{iters}] loss {loss.item():.4f} "
                  f"lr {optimizer.param_groups[0]['lr']:.3e} {time.time() - end:.2f}s/it", flush=True)
        end = time.time()


@torch.no_grad()
def validate(loader, model, gpu):
    model.eval()
    correct = torch.zeros(1, device=f"cuda:{gpu}")
    seen = torch.zeros(1, device=f"cuda:{gpu}")
    for images, target in loader:
        images = images.cuda(gpu, non_blocking=True)
        target = target.cuda(gpu, non_blocking=True)
        with torch.cuda.amp.autocast():
            output = model(images)
        correct += (output.argmax(1) == target).sum()
        seen += target.size(0)
    dist.all_reduce(correct)
    dist.all_reduce(seen)
    return (100.0 * correct / seen).item()


def main():
    args = get_parser().parse_args()
    ngpus_per_node = torch.cuda.device_count()
    mp.spawn(main_worker, nprocs=ngpus_per_node, args=(ngpus_per_node, args))


if __name__ == "__main__":
    main()
