#!/usr/bin/env python
"""ImageNet ResNet-50 training with gradient accumulation.

Ported from the Horovod version (pytorch_imagenet_resnet50.py). The
batches_per_allreduce option of hvd.DistributedOptimizer is emulated with
DDP.no_sync().
"""
import argparse
import contextlib
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, models, transforms


class hvd:
    """Tiny stand-in for the horovod.torch API on top of torch.distributed."""

    @staticmethod
    def init():
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        dist.init_process_group(backend="nccl", init_method="env://")

    @staticmethod
    def rank():
        return dist.get_rank() if dist.is_initialized() else 0

    @staticmethod
    def size():
        return dist.get_world_size() if dist.is_initialized() else 1

    @staticmethod
    def local_rank():
        return int(os.environ.get("LOCAL_RANK", 0))


class Metric:
    """Running average that is all-reduced across workers on demand."""

    def __init__(self, name):
        self.name = name
        self.sum = torch.zeros((), device="cuda")
        self.n = torch.zeros((), device="cuda")

    def update(self, val, n=1):
        self.sum += val.detach() * n
        self.n += n

    @property
    def avg(self):
        t = torch.stack([self.sum, self.n])
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return (t[0] / t[1]).item()


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-dir", default=os.path.expanduser("~/imagenet/train"))
    p.add_argument("--val-dir", default=os.path.expanduser("~/imagenet/validation"))
    p.add_argument("--log-dir", default="./logs")
    p.add_argument("--checkpoint-format", default="./checkpoint-{epoch}.pth.tar")
    p.add_argument("--batches-per-allreduce", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--val-batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--base-lr", type=float, default=0.0125)
    p.add_argument("--warmup-epochs", type=float, default=5)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--wd", type=float, default=5e-5)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def adjust_learning_rate(optimizer, args, epoch, batch_idx, steps):
    scale = hvd.size() * args.batches_per_allreduce
    if epoch < args.warmup_epochs:
        epoch += float(batch_idx + 1) / steps
        lr_adj = 1.0 / scale * (epoch * (scale - 1) / args.warmup_epochs + 1)
    elif epoch < 30:
        lr_adj = 1.0
    elif epoch < 60:
        lr_adj = 1e-1
    elif epoch < 80:
        lr_adj = 1e-2
    else:
        lr_adj = 1e-3
    for g in optimizer.param_groups:
        g["lr"] = args.base_lr * scale * lr_adj


def accuracy(output, target):
    return (output.argmax(dim=1) == target).float().mean()


def train(epoch, model, loader, sampler, optimizer, args, writer):
    model.train()
    sampler.set_epoch(epoch)
    train_loss, train_acc = Metric("train_loss"), Metric("train_accuracy")
    sub = args.batch_size
    t0 = time.time()
    for batch_idx, (data, target) in enumerate(loader):
        adjust_learning_rate(optimizer, args, epoch, batch_idx, len(loader))
        data = data.cuda(non_blocking=True)
        target = target.cuda(non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        chunks = range(0, len(data), sub)
        for i, start in enumerate(chunks):
            data_batch = data[start:start + sub]
            target_batch = target[start:start + sub]
            last = i == len(chunks) - 1
            # only the last micro-batch triggers the gradient all-reduce
            ctx = contextlib.nullcontext() if last else model.no_sync()
            with ctx:
                output = model(data_batch)
                loss = F.cross_entropy(output, target_batch)
                train_loss.update(loss, data_batch.size(0))
                train_acc.update(accuracy(output, target_batch), data_batch.size(0))
                (loss / len(chunks)).backward()
        optimizer.step()
        if batch_idx % 100 == 0 and hvd.rank() == 0:
            print(f"epoch {epoch} step {batch_idx}/{len(loader)} loss {loss.item():.4f} "
                  f"{time.time() - t0:.1f}s")

    avg_loss, avg_acc = train_loss.avg, train_acc.avg
    if writer is not None:
        writer.add_scalar("train/loss", avg_loss, epoch)
        writer.add_scalar("train/accuracy", avg_acc, epoch)


@torch.no_grad()
def validate(epoch, model, loader, writer):
    model.eval()
    val_loss, val_acc = Metric("val_loss"), Metric("val_accuracy")
    for data, target in loader:
        data, target = data.cuda(non_blocking=True), target.cuda(non_blocking=True)
        output = model(data)
        val_loss.update(F.cross_entropy(output, target), data.size(0))
        val_acc.update(accuracy(output, target), data.size(0))
    avg_loss, avg_acc = val_loss.avg, val_acc.avg
    if writer is not None:
        writer.add_scalar("val/loss", avg_loss, epoch)
        writer.add_scalar("val/accuracy", avg_acc, epoch)
        print(f"epoch {epoch}: val loss {avg_loss:.4f} acc {100 * avg_acc:.2f}%")


def save_checkpoint(model, optimizer, epoch, args):
    if hvd.rank() == 0:
        torch.save({"model": model.module.state_dict(),
                    "optimizer": optimizer.state_dict()},
                   args.checkpoint_format.format(epoch=epoch + 1))


def main():
    args = parse_args()
    hvd.init()
    torch.manual_seed(args.seed)
    torch.backends.cudnn.benchmark = True

    # rank 0 looks for the latest checkpoint; the epoch is broadcast to all workers
    resume_from_epoch = 0
    for try_epoch in range(args.epochs, 0, -1):
        if os.path.exists(args.checkpoint_format.format(epoch=try_epoch)):
            resume_from_epoch = try_epoch
            break
    t = torch.tensor(resume_from_epoch if hvd.rank() == 0 else 0, device="cuda")
    dist.broadcast(t, src=0)
    resume_from_epoch = int(t.item())

    writer = SummaryWriter(args.log_dir) if hvd.rank() == 0 else None
    allreduce_batch_size = args.batch_size * args.batches_per_allreduce

    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_dataset = datasets.ImageFolder(args.train_dir, transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), normalize]))
    val_dataset = datasets.ImageFolder(args.val_dir, transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), normalize]))
    train_sampler = DistributedSampler(train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    val_sampler = DistributedSampler(val_dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    train_loader = DataLoader(train_dataset, batch_size=allreduce_batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_dataset, batch_size=args.val_batch_size, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    model = models.resnet50()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda()
    optimizer = torch.optim.SGD(model.parameters(),
                                lr=args.base_lr * args.batches_per_allreduce * hvd.size(),
                                momentum=args.momentum, weight_decay=args.wd)

    if resume_from_epoch > 0:
        ckpt = torch.load(args.checkpoint_format.format(epoch=resume_from_epoch),
                          map_location=f"cuda:{hvd.local_rank()}")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])

    # DDP broadcasts rank 0's parameters at construction (hvd.broadcast_parameters)
    model = DDP(model, device_ids=[hvd.local_rank()], output_device=hvd.local_rank())

    for epoch in range(resume_from_epoch, args.epochs):
        train(epoch, model, train_loader, train_sampler, optimizer, args, writer)
        validate(epoch, model, val_loader, writer)
        save_checkpoint(model, optimizer, epoch, args)

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
