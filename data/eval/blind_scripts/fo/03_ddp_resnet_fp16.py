#!/usr/bin/env python3
# ResNet ImageNet training, DDP + AMP.
# torchrun --standalone --nproc_per_node=8 03_ddp_resnet_fp16.py /data/imagenet -a resnet50 --amp
import argparse
import os
import shutil
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision.models as models
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder

parser = argparse.ArgumentParser(description="ImageNet DDP training")
parser.add_argument("data", metavar="DIR")
parser.add_argument("-a", "--arch", default="resnet50")
parser.add_argument("-j", "--workers", default=8, type=int)
parser.add_argument("--epochs", default=90, type=int)
parser.add_argument("-b", "--batch-size", default=128, type=int, help="per-GPU batch size")
parser.add_argument("--lr", default=0.1, type=float, help="lr for batch 256, scaled linearly")
parser.add_argument("--momentum", default=0.9, type=float)
parser.add_argument("--wd", default=1e-4, type=float)
parser.add_argument("--amp", action="store_true", help="mixed precision training")
parser.add_argument("--grad-clip", default=0.0, type=float)
parser.add_argument("--print-freq", default=50, type=int)
parser.add_argument("--output", default="./checkpoints")


class AverageMeter:
    def __init__(self):
        self.sum, self.count = 0.0, 0

    def update(self, val, n=1):
        self.sum += val * n
        self.count += n

    @property
    def avg(self):
        return self.sum / max(1, self.count)


def build_data(args):
    normalize = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_set = ImageFolder(os.path.join(args.data, "train"), T.Compose([
        T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), normalize]))
    val_set = ImageFolder(os.path.join(args.data, "val"), T.Compose([
        T.Resize(256), T.CenterCrop(224), T.ToTensor(), normalize]))
    train_sampler = DistributedSampler(train_set)
    val_sampler = DistributedSampler(val_set, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)
    return train_loader, val_loader, train_sampler


def train_one_epoch(model, loader, criterion, optimizer, scaler, epoch, args, device):
    model.train()
    losses = AverageMeter()
    end = time.time()
    for i, (images, target) in enumerate(loader):
        images = images.to(device, non_blocking=True).to(memory_format=torch.channels_last)
        target = target.to(device, non_blocking=True)

        with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=args.amp):
            output = model(images)
            loss = criterion(output, target)

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if args.grad_clip > 0:
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        scaler.step(optimizer)
        scaler.update()

        losses.update(loss.item(), images.size(0))
        if args.rank == 0 and i % args.print_freq == 0:
            print(f"Epoch [{epoch}][{i}/{len(loader)}] loss {losses.avg:.4f} "
                  f"scale {scaler.get_scale():.0f} time {time.time() - end:.2f}s", flush=True)
            end = time.time()


@torch.no_grad()
def validate(model, loader, criterion, args, device):
    model.eval()
    totals = torch.zeros(4, device=device, dtype=torch.float64)
    for images, target in loader:
        images = images.to(device, non_blocking=True).to(memory_format=torch.channels_last)
        target = target.to(device, non_blocking=True)
        with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=args.amp):
            output = model(images)
            loss = criterion(output, target)
        _, pred = output.topk(5, 1, True, True)
        correct = pred.eq(target.view(-1, 1))
        totals[0] += loss.item() * images.size(0)
        totals[1] += correct[:, :1].sum()
        totals[2] += correct.sum()
        totals[3] += images.size(0)
    dist.all_reduce(totals)
    return (totals[0] / totals[3]).item(), (100 * totals[1] / totals[3]).item(), (100 * totals[2] / totals[3]).item()


def main():
    args = parser.parse_args()
    args.local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    args.rank = dist.get_rank()
    args.world_size = dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    torch.backends.cudnn.benchmark = True

    model = models.__dict__[args.arch]()
    model = model.to(device, memory_format=torch.channels_last)
    if args.amp:
        # fp16 weights + activations: halves memory so we can keep batch 128 on 16GB cards
        model = model.half()
    model = DDP(model, device_ids=[args.local_rank])

    criterion = nn.CrossEntropyLoss().to(device)
    lr = args.lr * args.batch_size * args.world_size / 256
    optimizer = torch.optim.SGD(model.parameters(), lr, momentum=args.momentum, weight_decay=args.wd)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    train_loader, val_loader, train_sampler = build_data(args)
    best_acc1 = 0.0
    os.makedirs(args.output, exist_ok=True)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        train_one_epoch(model, train_loader, criterion, optimizer, scaler, epoch, args, device)
        scheduler.step()
        val_loss, acc1, acc5 = validate(model, val_loader, criterion, args, device)

        if args.rank == 0:
            print(f" * Epoch {epoch} val loss {val_loss:.4f} Acc@1 {acc1:.3f} Acc@5 {acc5:.3f}", flush=True)
            is_best = acc1 > best_acc1
            best_acc1 = max(acc1, best_acc1)
            ckpt = {
                "epoch": epoch + 1,
                "arch": args.arch,
                "state_dict": model.module.state_dict(),
                "best_acc1": best_acc1,
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict(),
            }
            path = os.path.join(args.output, "checkpoint.pth.tar")
            torch.save(ckpt, path)
            if is_best:
                shutil.copyfile(path, os.path.join(args.output, "model_best.pth.tar"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
