# -*- coding: utf-8 -*-
"""
CIFAR-100 training, ResNet-50 / WRN from torchvision, DistributedDataParallel.

    python -m torch.distributed.launch --nproc_per_node=4 --use_env 09_cifar100_resnet.py --arch resnet50
    (torchrun --nproc_per_node=4 09_cifar100_resnet.py --arch resnet50 also works)
"""
import argparse
import datetime
import os
import time

import torch
import torch.backends.cudnn as cudnn
import torch.distributed as dist
import torch.nn as nn
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def get_parser():
    parser = argparse.ArgumentParser("cifar100 ddp")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=0)
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--data", default="./data")
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64, help="per gpu")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--wd", type=float, default=5e-4)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--output", default="./output")
    return parser


def init_distributed(args):
    if "WORLD_SIZE" in os.environ:
        args.rank = int(os.environ["RANK"])
        args.world_size = int(os.environ["WORLD_SIZE"])
        args.local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
        args.distributed = args.world_size > 1
    else:
        args.rank, args.world_size, args.distributed = 0, 1, False
    torch.cuda.set_device(args.local_rank)
    if args.distributed:
        dist.init_process_group(backend="nccl", init_method="env://",
                                timeout=datetime.timedelta(minutes=30))
        dist.barrier()


def build_model(arch, num_classes=100):
    model = torchvision.models.__dict__[arch](num_classes=num_classes)
    # CIFAR stem: 3x3 conv, no max-pool
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def reduce_mean(t, world_size):
    rt = t.clone()
    dist.all_reduce(rt, op=dist.ReduceOp.SUM)
    return rt / world_size


def main():
    args = get_parser().parse_args()
    init_distributed(args)
    is_master = args.rank == 0
    device = torch.device("cuda", args.local_rank)
    cudnn.benchmark = True

    mean, std = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
    train_tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(),
                          T.ToTensor(), T.Normalize(mean, std)])
    test_tf = T.Compose([T.ToTensor(), T.Normalize(mean, std)])

    if is_master:
        torchvision.datasets.CIFAR100(args.data, train=True, download=True)
        torchvision.datasets.CIFAR100(args.data, train=False, download=True)
    if args.distributed:
        dist.barrier()
    train_set = torchvision.datasets.CIFAR100(args.data, train=True, transform=train_tf)
    test_set = torchvision.datasets.CIFAR100(args.data, train=False, transform=test_tf)

    train_sampler = DistributedSampler(train_set, shuffle=True) if args.distributed else None
    test_sampler = DistributedSampler(test_set, shuffle=False) if args.distributed else None
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=(train_sampler is None),
                              sampler=train_sampler, num_workers=args.workers, pin_memory=True,
                              drop_last=True)
    test_loader = DataLoader(test_set, batch_size=256, sampler=test_sampler,
                             num_workers=args.workers, pin_memory=True)

    model = build_model(args.arch).to(device)
    if args.distributed:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        model = DistributedDataParallel(model, device_ids=[args.local_rank], output_device=args.local_rank)

    criterion = nn.CrossEntropyLoss().to(device)
    lr = args.lr * args.world_size * args.batch_size / 128
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=args.wd, nesterov=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    scaler = torch.cuda.amp.GradScaler()

    writer = None
    if is_master:
        os.makedirs(args.output, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.output, "tb"))

    best_acc = 0.0
    for epoch in range(args.epochs):
        model.train()
        tic = time.time()
        loss_meter = torch.zeros(1, device=device)
        for step, (images, labels) in enumerate(train_loader):
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            with torch.cuda.amp.autocast():
                logits = model(images)
                loss = criterion(logits, labels)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            loss_meter += loss.detach()
        scheduler.step()

        train_loss = loss_meter / len(train_loader)
        if args.distributed:
            train_loss = reduce_mean(train_loss, args.world_size)

        # evaluation (every rank, sharded test set)
        model.eval()
        correct = torch.zeros(1, device=device)
        total = torch.zeros(1, device=device)
        with torch.no_grad():
            for images, labels in test_loader:
                images = images.to(device, non_blocking=True)
                labels = labels.to(device, non_blocking=True)
                pred = model(images).argmax(1)
                correct += (pred == labels).sum()
                total += labels.size(0)
        if args.distributed:
            dist.all_reduce(correct)
            dist.all_reduce(total)
        acc = (correct / total).item() * 100

        if is_master:
            print(f"epoch {epoch:3d} | loss {train_loss.item():.4f} | acc {acc:.2f} | "
                  f"lr {scheduler.get_last_lr()[0]:.4f} | {time.time() - tic:.0f}s")
            writer.add_scalar("train/loss", train_loss.item(), epoch)
            writer.add_scalar("test/acc", acc, epoch)
            state = {
                "epoch": epoch,
                "model": model.module.state_dict() if args.distributed else model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "acc": acc,
            }
            torch.save(state, os.path.join(args.output, "last.pth"))
            if acc > best_acc:
                best_acc = acc
                torch.save(state, os.path.join(args.output, "best.pth"))

    if is_master:
        writer.close()
        print(f"best acc {best_acc:.2f}")
    if args.distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
