"""
Deep Learning Systems (Fall) - Lab 4: scaling ResNet-50 on ImageNet-100.

Launch on a 4-GPU node of the course cluster:

    python -m torch.distributed.launch --nproc_per_node=4 08_imagenet100_resnet50_launch.py \
        --data /datasets/imagenet100 --epochs 90 --batch-size 64

The batch size is per GPU.  Report the throughput (img/s) for 1, 2 and 4 GPUs.
"""
import argparse
import os
import shutil
import time

import torch
import torch.backends.cudnn as cudnn
import torch.distributed as dist
import torch.nn as nn
import torchvision.datasets as datasets
import torchvision.models as models
import torchvision.transforms as transforms
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def get_parser():
    parser = argparse.ArgumentParser(description="ImageNet-100 DDP lab")
    parser.add_argument("--data", metavar="DIR", default="/datasets/imagenet100")
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=90)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.1, help="lr for a global batch of 256")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--wd", type=float, default=1e-4)
    parser.add_argument("--print-freq", type=int, default=50)
    parser.add_argument("--resume", default="")
    parser.add_argument("--local_rank", type=int, default=0)
    return parser


class AverageMeter:
    def __init__(self):
        self.sum, self.count = 0.0, 0

    def update(self, val, n=1):
        self.sum += val * n
        self.count += n

    @property
    def avg(self):
        return self.sum / max(self.count, 1)


def accuracy(output, target, topk=(1, 5)):
    with torch.no_grad():
        maxk = max(topk)
        _, pred = output.topk(maxk, 1, True, True)
        correct = pred.t().eq(target.view(1, -1).expand_as(pred.t()))
        return [correct[:k].reshape(-1).float().sum() for k in topk]


def save_checkpoint(state, is_best, filename="checkpoint.pth.tar"):
    torch.save(state, filename)
    if is_best:
        shutil.copyfile(filename, "model_best.pth.tar")


def train(loader, model, criterion, optimizer, epoch, device, args):
    model.train()
    losses = AverageMeter()
    end = time.time()
    n_imgs = 0
    for i, (images, target) in enumerate(loader):
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        output = model(images)
        loss = criterion(output, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.update(loss.item(), images.size(0))
        n_imgs += images.size(0)
        if args.rank == 0 and i % args.print_freq == 0:
            elapsed = time.time() - end
            print(f"Epoch [{epoch}][{i}/{len(loader)}] loss {losses.avg:.4f} "
                  f"throughput {n_imgs * args.world_size / elapsed:.1f} img/s", flush=True)


def validate(loader, model, device):
    model.eval()
    stats = torch.zeros(3, device=device)
    with torch.no_grad():
        for images, target in loader:
            images, target = images.to(device), target.to(device)
            top1, top5 = accuracy(model(images), target)
            stats += torch.stack([top1, top5, torch.tensor(float(target.size(0)), device=device)])
    dist.all_reduce(stats)
    return (stats[0] / stats[2] * 100).item(), (stats[1] / stats[2] * 100).item()


def main():
    args = get_parser().parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    args.rank = dist.get_rank()
    args.world_size = dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    cudnn.benchmark = True

    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_ds = datasets.ImageFolder(os.path.join(args.data, "train"), transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), normalize]))
    val_ds = datasets.ImageFolder(os.path.join(args.data, "val"), transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), normalize]))
    val_idx = list(range(args.rank, len(val_ds), args.world_size))

    train_sampler = DistributedSampler(train_ds)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, val_idx), batch_size=args.batch_size,
                            shuffle=False, num_workers=args.workers, pin_memory=True)

    model = models.__dict__[args.arch](num_classes=100)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[args.local_rank])

    global_bs = args.batch_size * args.world_size
    lr = args.lr * global_bs / 256
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr, momentum=args.momentum, weight_decay=args.wd)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[30, 60, 80], gamma=0.1)

    start_epoch, best_acc1 = 0, 0.0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_acc1 = ckpt["epoch"], ckpt["best_acc1"]
        if args.rank == 0:
            print(f"resumed from {args.resume} (epoch {start_epoch})")

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        train(train_loader, model, criterion, optimizer, epoch, device, args)
        scheduler.step()
        acc1, acc5 = validate(val_loader, model.module, device)
        is_best = acc1 > best_acc1
        best_acc1 = max(acc1, best_acc1)
        if args.rank == 0:
            print(f" * Epoch {epoch} Acc@1 {acc1:.3f} Acc@5 {acc5:.3f} (best {best_acc1:.3f})", flush=True)
            save_checkpoint({
                "epoch": epoch + 1,
                "arch": args.arch,
                "state_dict": model.module.state_dict(),
                "best_acc1": best_acc1,
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
            }, is_best)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
