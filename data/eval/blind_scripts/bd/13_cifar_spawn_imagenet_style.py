"""
CIFAR-10 with a torchvision ResNet, multiprocessing-distributed training.
Structure copied (and simplified) from pytorch/examples/imagenet/main.py.

single node, all GPUs:
    python 13_cifar_spawn_imagenet_style.py --dist-url tcp://127.0.0.1:23456 --epochs 30
"""
import argparse
import os
import random
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.parallel
import torch.backends.cudnn as cudnn
import torch.distributed as dist
import torch.optim
import torch.multiprocessing as mp
import torch.utils.data
import torch.utils.data.distributed
import torchvision.transforms as transforms
import torchvision.datasets as datasets
import torchvision.models as models

parser = argparse.ArgumentParser(description='PyTorch CIFAR-10 Training')
parser.add_argument('--data', default='./data', help='path to dataset')
parser.add_argument('-a', '--arch', default='resnet18')
parser.add_argument('-j', '--workers', default=4, type=int)
parser.add_argument('--epochs', default=30, type=int)
parser.add_argument('-b', '--batch-size', default=256, type=int,
                    help='total batch size of all GPUs on the node')
parser.add_argument('--lr', '--learning-rate', default=0.1, type=float, dest='lr')
parser.add_argument('--momentum', default=0.9, type=float)
parser.add_argument('--wd', '--weight-decay', default=5e-4, type=float, dest='weight_decay')
parser.add_argument('-p', '--print-freq', default=50, type=int)
parser.add_argument('--dist-url', default='tcp://127.0.0.1:23456', type=str)
parser.add_argument('--dist-backend', default='nccl', type=str)
parser.add_argument('--seed', default=None, type=int)
parser.add_argument('--checkpoint', default='cifar_checkpoint.pth.tar')

best_acc1 = 0


def main():
    args = parser.parse_args()

    if args.seed is not None:
        random.seed(args.seed)
        torch.manual_seed(args.seed)
        cudnn.deterministic = True
        warnings.warn('You have chosen to seed training. This will turn on the CUDNN deterministic setting.')

    # download the dataset once in the main process
    datasets.CIFAR10(args.data, train=True, download=True)
    datasets.CIFAR10(args.data, train=False, download=True)

    ngpus_per_node = torch.cuda.device_count()
    args.world_size = ngpus_per_node
    # Use torch.multiprocessing.spawn to launch distributed processes: the
    # main_worker process function
    mp.spawn(main_worker, nprocs=ngpus_per_node, args=(args))


def main_worker(gpu, args):
    global best_acc1
    args.gpu = gpu
    args.rank = gpu
    print("Use GPU: {} for training".format(args.gpu))

    torch.cuda.set_device(args.gpu)
    dist.init_process_group(backend=args.dist_backend, init_method=args.dist_url,
                            world_size=args.world_size, rank=args.rank)

    # create model (CIFAR-10 has 10 classes)
    model = models.__dict__[args.arch](num_classes=10)
    model.cuda(args.gpu)
    # When using a single GPU per process and per DistributedDataParallel, we
    # need to divide the batch size ourselves based on the total number of GPUs
    args.batch_size = int(args.batch_size / args.world_size)
    args.workers = int((args.workers + args.world_size - 1) / args.world_size)
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])

    criterion = nn.CrossEntropyLoss().cuda(args.gpu)
    optimizer = torch.optim.SGD(model.parameters(), args.lr,
                                momentum=args.momentum, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    cudnn.benchmark = True

    normalize = transforms.Normalize(mean=[0.4914, 0.4822, 0.4465], std=[0.2470, 0.2435, 0.2616])
    train_dataset = datasets.CIFAR10(args.data, train=True, transform=transforms.Compose([
        transforms.RandomCrop(32, padding=4),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        normalize,
    ]))
    val_dataset = datasets.CIFAR10(args.data, train=False, transform=transforms.Compose([
        transforms.ToTensor(),
        normalize,
    ]))

    train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset)
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, shuffle=False,
        num_workers=args.workers, pin_memory=True, sampler=train_sampler)
    val_loader = torch.utils.data.DataLoader(
        val_dataset, batch_size=args.batch_size, shuffle=False,
        num_workers=args.workers, pin_memory=True)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        train(train_loader, model, criterion, optimizer, epoch, args)
        scheduler.step()

        if args.rank == 0:
            acc1 = validate(val_loader, model.module, criterion, args)
            is_best = acc1 > best_acc1
            best_acc1 = max(acc1, best_acc1)
            torch.save({
                'epoch': epoch + 1,
                'arch': args.arch,
                'state_dict': model.module.state_dict(),
                'best_acc1': best_acc1,
                'optimizer': optimizer.state_dict(),
                'scheduler': scheduler.state_dict(),
            }, args.checkpoint)
            if is_best:
                torch.save(model.module.state_dict(), 'model_best.pth')
        dist.barrier()

    dist.destroy_process_group()


def train(train_loader, model, criterion, optimizer, epoch, args):
    model.train()
    end = time.time()
    for i, (images, target) in enumerate(train_loader):
        images = images.cuda(args.gpu, non_blocking=True)
        target = target.cuda(args.gpu, non_blocking=True)

        output = model(images)
        loss = criterion(output, target)

        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

        if i % args.print_freq == 0 and args.rank == 0:
            acc = (output.argmax(1) == target).float().mean().item() * 100
            print('Epoch: [{0}][{1}/{2}]\tTime {3:.3f}\tLoss {4:.4f}\tAcc@1 {5:.2f}'.format(
                epoch, i, len(train_loader), time.time() - end, loss.item(), acc))
        end = time.time()


def validate(val_loader, model, criterion, args):
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    with torch.no_grad():
        for images, target in val_loader:
            images = images.cuda(args.gpu, non_blocking=True)
            target = target.cuda(args.gpu, non_blocking=True)
            output = model(images)
            loss_sum += criterion(output, target).item() * images.size(0)
            correct += (output.argmax(1) == target).sum().item()
            total += images.size(0)
    acc1 = 100.0 * correct / total
    print(' * Acc@1 {:.3f}  Loss {:.4f}'.format(acc1, loss_sum / total))
    return acc1


if __name__ == '__main__':
    main()
