"""ImageNet training with mp.spawn (one process per GPU), pytorch/examples style.

Kept the --dist-url / --multiprocessing-distributed interface of the old
examples so the cluster scripts did not have to change. Adds activation
checkpointing for large-resolution runs.
"""
import argparse
import os
import random
import shutil
import time
import warnings

import torch
import torch.backends.cudnn as cudnn
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.utils.data
import torch.utils.data.distributed
import torchvision.datasets as datasets
import torchvision.models as models
import torchvision.transforms as transforms
from torch.utils.checkpoint import checkpoint_sequential
from torch.utils.tensorboard import SummaryWriter

parser = argparse.ArgumentParser(description="PyTorch ImageNet Training")
parser.add_argument("data", metavar="DIR")
parser.add_argument("-a", "--arch", default="resnet101")
parser.add_argument("-j", "--workers", default=16, type=int, help="total data loading workers per node")
parser.add_argument("--epochs", default=90, type=int)
parser.add_argument("-b", "--batch-size", default=256, type=int,
                    help="total batch size of all GPUs on the current node")
parser.add_argument("--lr", default=0.1, type=float, help="initial learning rate for batch size 256")
parser.add_argument("--momentum", default=0.9, type=float)
parser.add_argument("--wd", default=1e-4, type=float)
parser.add_argument("--img-size", default=224, type=int)
parser.add_argument("--grad-ckpt-segments", default=0, type=int, help="0 disables activation checkpointing")
parser.add_argument("--resume", default="", type=str)
parser.add_argument("--world-size", default=1, type=int, help="number of nodes")
parser.add_argument("--rank", default=0, type=int, help="node rank")
parser.add_argument("--dist-url", default="tcp://127.0.0.1:23456", type=str)
parser.add_argument("--dist-backend", default="nccl", type=str)
parser.add_argument("--seed", default=None, type=int)
parser.add_argument("--log-dir", default="runs/imagenet")


class CheckpointedResNet(nn.Module):
    """Wraps a torchvision ResNet so layer1..layer4 run under activation checkpointing."""

    def __init__(self, net, segments):
        super().__init__()
        self.net, self.segments = net, segments
        self.stages = nn.Sequential(net.layer1, net.layer2, net.layer3, net.layer4)

    def forward(self, x):
        n = self.net
        x = n.maxpool(n.relu(n.bn1(n.conv1(x))))
        if self.training and self.segments > 0:
            x = checkpoint_sequential(self.stages, self.segments, x, use_reentrant=False)
        else:
            x = self.stages(x)
        return n.fc(torch.flatten(n.avgpool(x), 1))


def main():
    args = parser.parse_args()
    if args.seed is not None:
        warnings.warn("seeded training turns on CUDNN deterministic mode; it can be slow")
    ngpus_per_node = torch.cuda.device_count()
    # world_size from the command line is the number of nodes; turn it into the number of processes
    args.world_size = ngpus_per_node * args.world_size
    mp.spawn(main_worker, nprocs=ngpus_per_node, args=(ngpus_per_node, args))


def main_worker(gpu, ngpus_per_node, args):
    args.gpu = gpu
    args.rank = args.rank * ngpus_per_node + gpu
    torch.cuda.set_device(args.gpu)
    dist.init_process_group(backend=args.dist_backend, init_method=args.dist_url,
                            world_size=args.world_size, rank=args.rank)
    is_main = args.rank == 0
    if args.seed is not None:
        # spawned workers start from a fresh interpreter, so seed here and not in main()
        random.seed(args.seed)
        torch.manual_seed(args.seed)
        cudnn.deterministic = True

    net = models.__dict__[args.arch]()
    model = CheckpointedResNet(net, args.grad_ckpt_segments)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model) if args.img_size > 320 else model
    model.cuda(args.gpu)
    # batch size and workers are given per node; split them between this node's processes
    args.batch_size = int(args.batch_size / ngpus_per_node)
    args.workers = int((args.workers + ngpus_per_node - 1) / ngpus_per_node)
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])

    criterion = nn.CrossEntropyLoss().cuda(args.gpu)
    lr = args.lr * args.batch_size * args.world_size / 256
    optimizer = torch.optim.SGD(model.parameters(), lr, momentum=args.momentum, weight_decay=args.wd)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    start_epoch, best_acc1 = 0, 0.0
    if args.resume and os.path.isfile(args.resume):
        checkpoint = torch.load(args.resume, map_location=f"cuda:{args.gpu}")
        start_epoch = checkpoint["epoch"]
        best_acc1 = checkpoint["best_acc1"]
        model.module.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])

    cudnn.benchmark = args.seed is None
    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_dataset = datasets.ImageFolder(os.path.join(args.data, "train"), transforms.Compose([
        transforms.RandomResizedCrop(args.img_size), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), normalize]))
    val_dataset = datasets.ImageFolder(os.path.join(args.data, "val"), transforms.Compose([
        transforms.Resize(int(args.img_size * 256 / 224)), transforms.CenterCrop(args.img_size),
        transforms.ToTensor(), normalize]))
    train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset)
    val_sampler = torch.utils.data.distributed.DistributedSampler(val_dataset, shuffle=False, drop_last=True)
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size, shuffle=False,
                                               num_workers=args.workers, pin_memory=True, sampler=train_sampler,
                                               drop_last=True)
    val_loader = torch.utils.data.DataLoader(val_dataset, batch_size=args.batch_size, shuffle=False,
                                             num_workers=args.workers, pin_memory=True, sampler=val_sampler)

    writer = SummaryWriter(args.log_dir) if is_main else None
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        train(train_loader, model, criterion, optimizer, epoch, args, writer)
        acc1 = validate(val_loader, model, criterion, args)
        scheduler.step()

        if is_main:
            writer.add_scalar("val/acc1", acc1, epoch)
            is_best = acc1 > best_acc1
            best_acc1 = max(acc1, best_acc1)
            torch.save({"epoch": epoch + 1, "arch": args.arch, "state_dict": model.module.state_dict(),
                        "best_acc1": best_acc1, "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict()}, "checkpoint.pth.tar")
            if is_best:
                shutil.copyfile("checkpoint.pth.tar", "model_best.pth.tar")

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


def train(train_loader, model, criterion, optimizer, epoch, args, writer):
    model.train()
    end = time.time()
    for i, (images, target) in enumerate(train_loader):
        images = images.cuda(args.gpu, non_blocking=True)
        target = target.cuda(args.gpu, non_blocking=True)
        output = model(images)
        loss = criterion(output, target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if i % 100 == 0:
            stats = torch.stack([loss.detach(), (output.argmax(1) == target).float().mean()])
            dist.all_reduce(stats)
            stats /= args.world_size
            if writer is not None:
                step = epoch * len(train_loader) + i
                writer.add_scalar("train/loss", stats[0].item(), step)
                writer.add_scalar("train/acc1", stats[1].item(), step)
                print(f"Epoch [{epoch}][{i}/{len(train_loader)}] loss {stats[0].item():.4f} "
                      f"acc1 {100 * stats[1].item():.2f} {time.time() - end:.1f}s")


@torch.no_grad()
def validate(val_loader, model, criterion, args):
    model.eval()
    totals = torch.zeros(3, device=f"cuda:{args.gpu}")
    for images, target in val_loader:
        images = images.cuda(args.gpu, non_blocking=True)
        target = target.cuda(args.gpu, non_blocking=True)
        output = model(images)
        totals[0] += criterion(output, target) * target.size(0)
        totals[1] += (output.argmax(1) == target).sum()
        totals[2] += target.size(0)
    dist.all_reduce(totals)
    return (100.0 * totals[1] / totals[2]).item()


if __name__ == "__main__":
    main()
