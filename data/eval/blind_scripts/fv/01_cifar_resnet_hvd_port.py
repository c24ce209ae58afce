#!/usr/bin/env python
"""CIFAR-10 ResNet-18 training.

Originally written for Horovod (hvd.init / DistributedOptimizer); ported to
torch.distributed + DDP so it can be started with torchrun on the new cluster.
The hvd-style helpers below keep the rest of the code unchanged.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, models, transforms


# ---------------------------------------------------------------------------
# hvd-compatible helpers
# ---------------------------------------------------------------------------
def rank():
    return dist.get_rank() if dist.is_initialized() else 0


def size():
    return dist.get_world_size() if dist.is_initialized() else 1


def local_rank():
    return int(os.environ.get("LOCAL_RANK", 0))


def metric_average(val, name):
    tensor = torch.tensor(val)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.item() / size()


def parse_args():
    p = argparse.ArgumentParser(description="CIFAR-10 ResNet (DDP)")
    p.add_argument("--data-dir", default="./data")
    p.add_argument("--log-dir", default="./logs")
    p.add_argument("--checkpoint-format", default="./checkpoints/checkpoint-{epoch}.pth.tar")
    p.add_argument("--batch-size", type=int, default=128, help="per-worker batch size")
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--base-lr", type=float, default=0.0125, help="learning rate for a single worker")
    p.add_argument("--warmup-epochs", type=float, default=5)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--wd", type=float, default=5e-4)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--sync-bn", action="store_true")
    p.add_argument("--log-interval", type=int, default=50)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def build_model(num_classes=10):
    model = models.resnet18(num_classes=num_classes)
    # CIFAR stem: 3x3 conv, no max-pool
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def get_loaders(args):
    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    train_tf = transforms.Compose([
        transforms.RandomCrop(32, padding=4),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    val_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])

    # rank 0 downloads, the others wait and then read the extracted files
    if rank() != 0:
        dist.barrier()
    train_set = datasets.CIFAR10(args.data_dir, train=True, download=True, transform=train_tf)
    val_set = datasets.CIFAR10(args.data_dir, train=False, download=True, transform=val_tf)
    if rank() == 0:
        dist.barrier()

    train_sampler = DistributedSampler(train_set, num_replicas=size(), rank=rank(), shuffle=True)
    val_sampler = DistributedSampler(val_set, num_replicas=size(), rank=rank(), shuffle=False)
    kw = dict(num_workers=args.workers, pin_memory=True, persistent_workers=args.workers > 0)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, drop_last=True, **kw)
    val_loader = DataLoader(val_set, batch_size=256, sampler=val_sampler, **kw)
    return train_loader, train_sampler, val_loader


def adjust_learning_rate(optimizer, epoch, batch_idx, steps_per_epoch, args):
    # Horovod recipe: linear warmup to base_lr * size(), then step decay
    if epoch < args.warmup_epochs:
        ep = epoch + float(batch_idx + 1) / steps_per_epoch
        lr_adj = 1.0 / size() * (ep * (size() - 1) / args.warmup_epochs + 1)
    elif epoch < 30:
        lr_adj = 1.0
    elif epoch < 60:
        lr_adj = 1e-1
    elif epoch < 80:
        lr_adj = 1e-2
    else:
        lr_adj = 1e-3
    for group in optimizer.param_groups:
        group["lr"] = args.base_lr * size() * lr_adj


def train(epoch, model, loader, sampler, optimizer, scaler, args, writer):
    model.train()
    sampler.set_epoch(epoch)
    device = torch.device("cuda", local_rank())
    running_loss, correct, seen = 0.0, 0, 0
    t0 = time.time()
    for batch_idx, (images, target) in enumerate(loader):
        adjust_learning_rate(optimizer, epoch, batch_idx, len(loader), args)
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)

        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
            output = model(images)
            loss = F.cross_entropy(output, target, label_smoothing=args.label_smoothing)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

        running_loss += loss.item() * images.size(0)
        correct += (output.argmax(dim=1) == target).sum().item()
        seen += images.size(0)
        if batch_idx % args.log_interval == 0 and rank() == 0:
            print(f"epoch {epoch} [{batch_idx}/{len(loader)}] loss {loss.item():.4f} "
                  f"lr {optimizer.param_groups[0]['lr']:.4f} ({time.time() - t0:.1f}s)")

    train_loss = metric_average(running_loss / seen, "train_loss")
    train_acc = metric_average(correct / seen, "train_accuracy")
    if writer is not None:
        writer.add_scalar("train/loss", train_loss, epoch)
        writer.add_scalar("train/accuracy", train_acc, epoch)
    return train_loss, train_acc


@torch.no_grad()
def validate(epoch, model, loader, writer):
    model.eval()
    device = torch.device("cuda", local_rank())
    val_loss, val_correct, n = 0.0, 0, 0
    for images, target in loader:
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        output = model(images)
        val_loss += F.cross_entropy(output, target, reduction="sum").item()
        val_correct += (output.argmax(dim=1) == target).sum().item()
        n += images.size(0)

    val_loss = metric_average(val_loss / n, "avg_loss")
    val_acc = metric_average(val_correct / n, "avg_accuracy")
    if writer is not None:
        writer.add_scalar("val/loss", val_loss, epoch)
        writer.add_scalar("val/accuracy", val_acc, epoch)
    if rank() == 0:
        print(f"epoch {epoch}: val loss {val_loss:.4f}  val acc {100.0 * val_acc:.2f}%")
    return val_acc


def save_checkpoint(model, optimizer, scaler, epoch, args):
    if rank() != 0:
        return
    path = args.checkpoint_format.format(epoch=epoch + 1)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({
        "model": model.module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "epoch": epoch + 1,
    }, path)


def main():
    args = parse_args()
    torch.cuda.set_device(local_rank())
    dist.init_process_group(backend="nccl")
    torch.manual_seed(args.seed)
    torch.backends.cudnn.benchmark = True

    train_loader, train_sampler, val_loader = get_loaders(args)

    model = build_model()
    if args.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.cuda()

    # resume from the newest checkpoint that exists (rank 0 decides, everybody follows)
    resume_from_epoch = 0
    if rank() == 0:
        for try_epoch in range(args.epochs, 0, -1):
            if os.path.exists(args.checkpoint_format.format(epoch=try_epoch)):
                resume_from_epoch = try_epoch
                break
    obj = [resume_from_epoch]
    dist.broadcast_object_list(obj, src=0)
    resume_from_epoch = obj[0]

    optimizer = optim.SGD(model.parameters(), lr=args.base_lr * size(),
                          momentum=args.momentum, weight_decay=args.wd, nesterov=True)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    if resume_from_epoch > 0:
        ckpt = torch.load(args.checkpoint_format.format(epoch=resume_from_epoch), map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])

    model = DDP(model, device_ids=[local_rank()])
    writer = SummaryWriter(args.log_dir) if rank() == 0 else None

    best_acc = 0.0
    for epoch in range(resume_from_epoch, args.epochs):
        train(epoch, model, train_loader, train_sampler, optimizer, scaler, args, writer)
        acc = validate(epoch, model, val_loader, writer)
        save_checkpoint(model, optimizer, scaler, epoch, args)
        best_acc = max(best_acc, acc)

    if writer is not None:
        writer.close()
        print(f"best val accuracy {100.0 * best_acc:.2f}%")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
