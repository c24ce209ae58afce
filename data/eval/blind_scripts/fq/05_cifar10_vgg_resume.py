"""VGG-16 (BN) on CIFAR-10, DDP with mp.spawn, resumable.

Train:   python 05_cifar10_vgg_resume.py --world-size 8
Resume:  python 05_cifar10_vgg_resume.py --world-size 8 --resume runs/vgg16/checkpoint.pth
"""
import argparse
import os
import shutil
import time

import torch
import torch.backends.cudnn as cudnn
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

VGG16 = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]


class VGG(nn.Module):
    def __init__(self, cfg=VGG16, num_classes=10):
        super().__init__()
        layers, c = [], 3
        for v in cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers += [nn.Conv2d(c, v, 3, padding=1), nn.BatchNorm2d(v), nn.ReLU(inplace=True)]
                c = v
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Dropout(0.5), nn.Linear(512, 512), nn.ReLU(True),
            nn.Dropout(0.5), nn.Linear(512, num_classes),
        )

    def forward(self, x):
        return self.classifier(torch.flatten(self.features(x), 1))


class AverageMeter:
    def __init__(self):
        self.sum, self.count = 0.0, 0

    def update(self, val, n=1):
        self.sum += val * n
        self.count += n

    @property
    def avg(self):
        return self.sum / max(self.count, 1)


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="./data")
    parser.add_argument("--world-size", type=int, default=torch.cuda.device_count())
    parser.add_argument("--epochs", type=int, default=160)
    parser.add_argument("--batch-size", type=int, default=128, help="per process")
    parser.add_argument("--base-lr", type=float, default=0.05, help="for a total batch of 128")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight-decay", type=float, default=5e-4)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--resume", default="", type=str)
    parser.add_argument("--save-dir", default="runs/vgg16")
    parser.add_argument("--print-freq", type=int, default=50)
    return parser.parse_args()


def save_checkpoint(state, is_best, save_dir):
    path = os.path.join(save_dir, "checkpoint.pth")
    torch.save(state, path)
    if is_best:
        shutil.copyfile(path, os.path.join(save_dir, "model_best.pth"))


def accuracy_counts(output, target):
    return (output.argmax(1) == target).sum()


def validate(model, loader, criterion, rank):
    model.eval()
    stats = torch.zeros(3, device=rank)
    with torch.no_grad():
        for images, target in loader:
            images, target = images.cuda(rank, non_blocking=True), target.cuda(rank, non_blocking=True)
            output = model(images)
            stats[0] += criterion(output, target) * target.size(0)
            stats[1] += accuracy_counts(output, target)
            stats[2] += target.size(0)
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item(), (100.0 * stats[1] / stats[2]).item()


def train_epoch(model, loader, criterion, optimizer, epoch, rank, print_freq):
    model.train()
    losses = AverageMeter()
    end = time.time()
    for i, (images, target) in enumerate(loader):
        images, target = images.cuda(rank, non_blocking=True), target.cuda(rank, non_blocking=True)
        output = model(images)
        loss = criterion(output, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.update(loss.item(), images.size(0))
        if rank == 0 and i % print_freq == 0:
            print(f"Epoch [{epoch}][{i}/{len(loader)}]  loss {losses.avg:.4f}  "
                  f"time {time.time() - end:.3f}")
        end = time.time()


def main_worker(rank, args):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "23456"
    torch.cuda.set_device(rank)
    dist.init_process_group(backend="nccl", init_method="env://",
                            world_size=args.world_size, rank=rank)
    cudnn.benchmark = True

    model = VGG().cuda(rank)
    model = DistributedDataParallel(model, device_ids=[rank])
    criterion = nn.CrossEntropyLoss().cuda(rank)
    lr = args.base_lr * args.batch_size * args.world_size / 128
    optimizer = torch.optim.SGD(model.parameters(), lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[80, 120], gamma=0.1)

    start_epoch, best_acc = 0, 0.0
    if args.resume:
        if os.path.isfile(args.resume):
            if rank == 0:
                print(f"=> loading checkpoint '{args.resume}'")
            checkpoint = torch.load(args.resume)
            start_epoch = checkpoint["epoch"]
            best_acc = checkpoint["best_acc"]
            model.module.load_state_dict(checkpoint["state_dict"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            scheduler.load_state_dict(checkpoint["scheduler"])
            if rank == 0:
                print(f"=> loaded checkpoint (epoch {start_epoch})")
        elif rank == 0:
            print(f"=> no checkpoint found at '{args.resume}'")

    normalize = transforms.Normalize(mean=[0.491, 0.482, 0.447], std=[0.247, 0.243, 0.262])
    train_ds = datasets.CIFAR10(args.data, train=True, transform=transforms.Compose([
        transforms.RandomCrop(32, 4), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), normalize]))
    val_ds = datasets.CIFAR10(args.data, train=False, transform=transforms.Compose([
        transforms.ToTensor(), normalize]))
    train_sampler = DistributedSampler(train_ds, num_replicas=args.world_size, rank=rank)
    val_sampler = DistributedSampler(val_ds, num_replicas=args.world_size, rank=rank, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=256, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        train_epoch(model, train_loader, criterion, optimizer, epoch, rank, args.print_freq)
        scheduler.step()
        val_loss, acc = validate(model, val_loader, criterion, rank)

        if rank == 0:
            is_best = acc > best_acc
            best_acc = max(acc, best_acc)
            print(f" * epoch {epoch}  val loss {val_loss:.4f}  acc {acc:.2f}  best {best_acc:.2f}")
            save_checkpoint({
                "epoch": epoch + 1,
                "state_dict": model.module.state_dict(),
                "best_acc": best_acc,
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
            }, is_best, args.save_dir)

    dist.destroy_process_group()


def main():
    args = parse_args()
    os.makedirs(args.save_dir, exist_ok=True)
    datasets.CIFAR10(args.data, train=True, download=True)
    datasets.CIFAR10(args.data, train=False, download=True)
    mp.spawn(main_worker, nprocs=args.world_size, args=(args,))


if __name__ == "__main__":
    main()
