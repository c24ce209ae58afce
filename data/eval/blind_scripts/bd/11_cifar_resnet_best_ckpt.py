#!/usr/bin/env python3
"""
train_cifar_ddp.py

Small ResNet on CIFAR-10, DDP with torchrun. Keeps the best checkpoint.

    torchrun --nproc_per_node=4 11_cifar_resnet_best_ckpt.py --epochs 40 --bs 128

Helpers (reduce_tensor, AverageMeter) are from the pytorch/examples imagenet script.
"""
import argparse
import os
import shutil
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
import torch.backends.cudnn as cudnn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
import torchvision
import torchvision.transforms as transforms


class AverageMeter(object):
    """Computes and stores the average and current value"""
    def __init__(self, name, fmt=':f'):
        self.name = name
        self.fmt = fmt
        self.reset()

    def reset(self):
        self.val = 0
        self.avg = 0
        self.sum = 0
        self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count

    def __str__(self):
        fmtstr = '{name} {val' + self.fmt + '} ({avg' + self.fmt + '})'
        return fmtstr.format(**self.__dict__)


def reduce_tensor(tensor, world_size):
    rt = tensor.clone()
    dist.all_reduce(rt, op=dist.ReduceOp.SUM)
    rt /= world_size
    return rt


class ResBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.skip = None
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        idt = x if self.skip is None else self.skip(x)
        x = F.relu(self.b1(self.c1(x)))
        x = self.b2(self.c2(x))
        return F.relu(x + idt)


class SmallResNet(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        self.stage1 = nn.Sequential(ResBlock(64, 64), ResBlock(64, 64))
        self.stage2 = nn.Sequential(ResBlock(64, 128, 2), ResBlock(128, 128))
        self.stage3 = nn.Sequential(ResBlock(128, 256, 2), ResBlock(256, 256))
        self.fc = nn.Linear(256, num_classes)

    def forward(self, x):
        x = self.stem(x)
        x = self.stage3(self.stage2(self.stage1(x)))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)


def validate(val_loader, model, criterion, device, world_size):
    losses = AverageMeter('Loss', ':.4e')
    top1 = AverageMeter('Acc@1', ':6.2f')
    model.eval()
    with torch.no_grad():
        for images, target in val_loader:
            images = images.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            output = model(images)
            loss = criterion(output, target)
            acc1 = (output.argmax(1) == target).float().mean() * 100.0

            # average over the GPUs so every process has the global numbers
            loss = reduce_tensor(loss.detach(), world_size)
            acc1 = reduce_tensor(acc1, world_size)
            losses.update(loss.item(), images.size(0))
            top1.update(acc1.item(), images.size(0))
    return top1.avg, losses.avg


def save_checkpoint(state, is_best, filename='checkpoint.pth.tar'):
    torch.save(state, filename)
    if is_best:
        shutil.copyfile(filename, 'model_best.pth.tar')


def main():
    parser = argparse.ArgumentParser(description='CIFAR-10 DDP training')
    parser.add_argument('--data', default='./data')
    parser.add_argument('--epochs', default=40, type=int)
    parser.add_argument('--bs', default=128, type=int, help='batch size per gpu')
    parser.add_argument('--lr', default=0.05, type=float)
    parser.add_argument('--wd', default=5e-4, type=float)
    parser.add_argument('--print-freq', default=50, type=int)
    args = parser.parse_args()

    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend='nccl', init_method='env://')
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    device = torch.device('cuda', local_rank)
    cudnn.benchmark = True

    normalize = transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010))
    if rank == 0:
        torchvision.datasets.CIFAR10(args.data, train=True, download=True)
        torchvision.datasets.CIFAR10(args.data, train=False, download=True)
    dist.barrier()
    train_dataset = torchvision.datasets.CIFAR10(args.data, train=True, transform=transforms.Compose([
        transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), normalize]))
    val_dataset = torchvision.datasets.CIFAR10(args.data, train=False, transform=transforms.Compose([
        transforms.ToTensor(), normalize]))

    train_sampler = DistributedSampler(train_dataset)
    val_sampler = DistributedSampler(val_dataset, shuffle=False)
    train_loader = DataLoader(train_dataset, batch_size=args.bs, sampler=train_sampler,
                              num_workers=4, pin_memory=True)
    val_loader = DataLoader(val_dataset, batch_size=250, sampler=val_sampler,
                            num_workers=4, pin_memory=True)

    model = SmallResNet().to(device)
    model = DDP(model, device_ids=[local_rank])
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(model.parameters(), args.lr * world_size, momentum=0.9,
                                weight_decay=args.wd)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    best_acc1 = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        batch_time = AverageMeter('Time', ':6.3f')
        losses = AverageMeter('Loss', ':.4e')
        end = time.time()
        for i, (images, target) in enumerate(train_loader):
            images = images.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            output = model(images)
            loss = criterion(output, target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

            losses.update(loss.item(), images.size(0))
            batch_time.update(time.time() - end)
            end = time.time()
            if rank == 0 and i % args.print_freq == 0:
                print(f'Epoch: [{epoch}][{i}/{len(train_loader)}]  {batch_time}  {losses}')
        scheduler.step()

        # evaluate on validation set and remember best acc@1
        if rank == 0:
            acc1, val_loss = validate(val_loader, model, criterion, device, world_size)
            is_best = acc1 > best_acc1
            best_acc1 = max(acc1, best_acc1)
            print(f' * Epoch {epoch}  Acc@1 {acc1:.3f}  val loss {val_loss:.4f}  best {best_acc1:.3f}')
            save_checkpoint({
                'epoch': epoch + 1,
                'state_dict': model.module.state_dict(),
                'best_acc1': best_acc1,
                'optimizer': optimizer.state_dict(),
                'scheduler': scheduler.state_dict(),
            }, is_best)

    if rank == 0:
        print(f'done, best Acc@1 {best_acc1:.3f}')
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
