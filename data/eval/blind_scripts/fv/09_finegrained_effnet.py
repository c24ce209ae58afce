"""Fine-grained classification (CUB / Stanford Cars folders) with EfficientNet-B3.

Migrated from the apex imagenet example layout: apex.parallel.DDP -> torch DDP,
amp.scale_loss -> GradScaler. Launch with torchrun.
"""
import argparse
import json
import os
import shutil
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from torchvision.models import efficientnet_b3, EfficientNet_B3_Weights


def parse():
    parser = argparse.ArgumentParser()
    parser.add_argument("data")
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("-b", "--batch-size", type=int, default=24, help="per process")
    parser.add_argument("--lr", type=float, default=0.01, help="lr per 256 images")
    parser.add_argument("--wd", type=float, default=1e-4)
    parser.add_argument("--img-size", type=int, default=448)
    parser.add_argument("-j", "--workers", type=int, default=8)
    parser.add_argument("--print-freq", type=int, default=20)
    parser.add_argument("--out", default="runs/effb3")
    parser.add_argument("--resume", default="")
    return parser.parse_args()


class AverageMeter:
    def __init__(self):
        self.sum, self.count = 0.0, 0

    def update(self, val, n=1):
        self.sum += val * n
        self.count += n

    @property
    def avg(self):
        return self.sum / max(1, self.count)


def reduce_tensor(tensor, world_size):
    rt = tensor.clone()
    dist.all_reduce(rt, op=dist.ReduceOp.SUM)
    return rt / world_size


def accuracy(output, target, topk=(1,)):
    maxk = max(topk)
    _, pred = output.topk(maxk, 1, True, True)
    correct = pred.t().eq(target.view(1, -1))
    return [correct[:k].reshape(-1).float().sum() * (100.0 / target.size(0)) for k in topk]


def train_epoch(loader, model, criterion, optimizer, scheduler, scaler, epoch, args):
    model.train()
    losses, top1 = AverageMeter(), AverageMeter()
    end = time.time()
    for i, (images, target) in enumerate(loader):
        images = images.cuda(non_blocking=True)
        target = target.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            output = model(images)
            loss = criterion(output, target)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()

        if i % args.print_freq == 0:
            prec1 = accuracy(output.detach(), target)[0]
            reduced_loss = reduce_tensor(loss.detach(), args.world_size)
            prec1 = reduce_tensor(prec1, args.world_size)
            losses.update(reduced_loss.item(), images.size(0))
            top1.update(prec1.item(), images.size(0))
            if args.rank == 0:
                print(f"Epoch [{epoch}][{i}/{len(loader)}] loss {losses.avg:.4f} prec@1 {top1.avg:.2f} "
                      f"lr {scheduler.get_last_lr()[0]:.5f} {time.time() - end:.1f}s")
    return losses.avg


@torch.no_grad()
def validate(loader, model, criterion, args):
    model.eval()
    losses, top1, top5 = AverageMeter(), AverageMeter(), AverageMeter()
    for images, target in loader:
        images = images.cuda(non_blocking=True)
        target = target.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            output = model(images)
        loss = criterion(output.float(), target)
        prec1, prec5 = accuracy(output, target, topk=(1, 5))
        losses.update(loss.item(), images.size(0))
        top1.update(prec1.item(), images.size(0))
        top5.update(prec5.item(), images.size(0))
    return losses.avg, top1.avg, top5.avg


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    args.rank, args.world_size = dist.get_rank(), dist.get_world_size()
    torch.backends.cudnn.benchmark = True

    normalize = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), transforms.Compose([
        transforms.RandomResizedCrop(args.img_size, scale=(0.25, 1.0)), transforms.RandomHorizontalFlip(),
        transforms.ColorJitter(0.2, 0.2, 0.2), transforms.ToTensor(), normalize]))
    val_set = datasets.ImageFolder(os.path.join(args.data, "test"), transforms.Compose([
        transforms.Resize(int(args.img_size / 0.875)), transforms.CenterCrop(args.img_size),
        transforms.ToTensor(), normalize]))
    num_classes = len(train_set.classes)

    train_sampler = DistributedSampler(train_set)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    model = efficientnet_b3(weights=EfficientNet_B3_Weights.IMAGENET1K_V1)
    model.classifier[1] = nn.Linear(model.classifier[1].in_features, num_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda()

    args.lr = args.lr * args.batch_size * args.world_size / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.wd, nesterov=True)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, epochs=args.epochs,
                                                    steps_per_epoch=len(train_loader), pct_start=0.05)
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1).cuda()

    start_epoch, best_prec1 = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=f"cuda:{local_rank}")
        model.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_prec1 = ckpt["epoch"], ckpt["best_prec1"]

    model = DDP(model, device_ids=[local_rank])
    if args.rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        train_loss = train_epoch(train_loader, model, criterion, optimizer, scheduler, scaler, epoch, args)
        val_loss, prec1, prec5 = validate(val_loader, model, criterion, args)

        if args.rank == 0:
            print(f" * epoch {epoch} val loss {val_loss:.4f} Prec@1 {prec1:.3f} Prec@5 {prec5:.3f}")
            is_best = prec1 > best_prec1
            best_prec1 = max(prec1, best_prec1)
            path = os.path.join(args.out, "checkpoint.pth.tar")
            torch.save({"epoch": epoch + 1, "state_dict": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                        "scaler": scaler.state_dict(), "best_prec1": best_prec1}, path)
            if is_best:
                shutil.copyfile(path, os.path.join(args.out, "model_best.pth.tar"))
            with open(os.path.join(args.out, "log.jsonl"), "a") as f:
                f.write(json.dumps({"epoch": epoch, "train_loss": train_loss, "val_loss": val_loss,
                                    "prec1": prec1, "prec5": prec5}) + "\n")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
