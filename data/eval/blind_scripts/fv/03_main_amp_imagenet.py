"""ImageNet training, derived from apex/examples/imagenet/main_amp.py.

apex.amp and apex.parallel.DistributedDataParallel were replaced by
torch.amp and torch.nn.parallel.DistributedDataParallel; the launch
command and the argument handling are kept as they were.
"""
import argparse
import os
import shutil
import time

import torch
import torch.backends.cudnn as cudnn
import torch.distributed as dist
import torch.nn as nn
import torch.optim
import torch.utils.data
import torch.utils.data.distributed
import torchvision.datasets as datasets
import torchvision.models as models
import torchvision.transforms as transforms
from torch.nn.parallel import DistributedDataParallel as DDP

model_names = sorted(name for name in models.__dict__
                     if name.islower() and not name.startswith("__")
                     and callable(models.__dict__[name]))


def parse():
    parser = argparse.ArgumentParser(description="PyTorch ImageNet Training")
    parser.add_argument("data", metavar="DIR", help="path to dataset")
    parser.add_argument("--arch", "-a", metavar="ARCH", default="resnet18", choices=model_names)
    parser.add_argument("-j", "--workers", default=4, type=int, metavar="N")
    parser.add_argument("--epochs", default=90, type=int, metavar="N")
    parser.add_argument("--start-epoch", default=0, type=int, metavar="N")
    parser.add_argument("-b", "--batch-size", default=256, type=int, metavar="N",
                        help="mini-batch size per process (default: 256)")
    parser.add_argument("--lr", "--learning-rate", default=0.1, type=float, metavar="LR",
                        help="Initial learning rate.  Will be scaled by <global batch size>/256")
    parser.add_argument("--momentum", default=0.9, type=float, metavar="M")
    parser.add_argument("--weight-decay", "--wd", default=1e-4, type=float, metavar="W")
    parser.add_argument("--print-freq", "-p", default=10, type=int, metavar="N")
    parser.add_argument("--resume", default="", type=str, metavar="PATH")
    parser.add_argument("-e", "--evaluate", dest="evaluate", action="store_true")
    parser.add_argument("--pretrained", dest="pretrained", action="store_true")
    parser.add_argument("--amp", action="store_true", help="native mixed precision (was --opt-level O1)")
    parser.add_argument("--local_rank", default=0, type=int)
    parser.add_argument("--sync_bn", action="store_true", help="enabling apex sync BN.")
    parser.add_argument("--channels-last", type=bool, default=False)
    return parser.parse_args()


class AverageMeter(object):
    def __init__(self):
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


def reduce_tensor(tensor, world_size):
    if world_size == 1:
        return tensor
    rt = tensor.clone()
    dist.all_reduce(rt, op=dist.ReduceOp.SUM)
    rt /= world_size
    return rt


def accuracy(output, target, topk=(1,)):
    maxk = max(topk)
    batch_size = target.size(0)
    _, pred = output.topk(maxk, 1, True, True)
    pred = pred.t()
    correct = pred.eq(target.view(1, -1).expand_as(pred))
    res = []
    for k in topk:
        correct_k = correct[:k].reshape(-1).float().sum(0, keepdim=True)
        res.append(correct_k.mul_(100.0 / batch_size))
    return res


def adjust_learning_rate(optimizer, epoch, step, len_epoch, args):
    """LR schedule that should yield 76% converged accuracy with batch size 256"""
    factor = epoch // 30
    if epoch >= 80:
        factor = factor + 1
    lr = args.lr * (0.1 ** factor)
    # warmup
    if epoch < 5:
        lr = lr * float(1 + step + epoch * len_epoch) / (5. * len_epoch)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr


def train(train_loader, model, criterion, optimizer, scaler, epoch, args):
    batch_time, losses, top1, top5 = AverageMeter(), AverageMeter(), AverageMeter(), AverageMeter()
    model.train()
    end = time.time()
    for i, (images, target) in enumerate(train_loader):
        adjust_learning_rate(optimizer, epoch, i, len(train_loader), args)
        images = images.cuda(non_blocking=True)
        target = target.cuda(non_blocking=True)
        if args.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)

        with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
            output = model(images)
            loss = criterion(output, target)

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

        if i % args.print_freq == 0:
            prec1, prec5 = accuracy(output.data, target, topk=(1, 5))
            reduced_loss = reduce_tensor(loss.data, args.world_size)
            prec1 = reduce_tensor(prec1, args.world_size)
            prec5 = reduce_tensor(prec5, args.world_size)
            losses.update(reduced_loss.item(), images.size(0))
            top1.update(prec1.item(), images.size(0))
            top5.update(prec5.item(), images.size(0))
            torch.cuda.synchronize()
            batch_time.update((time.time() - end) / args.print_freq)
            end = time.time()
            if args.rank == 0:
                print(f"Epoch: [{epoch}][{i}/{len(train_loader)}]\t"
                      f"Time {batch_time.val:.3f} ({batch_time.avg:.3f})\t"
                      f"Speed {args.world_size * args.batch_size / batch_time.val:.1f}\t"
                      f"Loss {losses.val:.4f} ({losses.avg:.4f})\t"
                      f"Prec@1 {top1.val:.3f} ({top1.avg:.3f})")


@torch.no_grad()
def validate(val_loader, model, criterion, args):
    losses, top1, top5 = AverageMeter(), AverageMeter(), AverageMeter()
    model.eval()
    for images, target in val_loader:
        images = images.cuda(non_blocking=True)
        target = target.cuda(non_blocking=True)
        output = model(images)
        loss = criterion(output, target)
        prec1, prec5 = accuracy(output, target, topk=(1, 5))
        losses.update(reduce_tensor(loss, args.world_size).item(), images.size(0))
        top1.update(reduce_tensor(prec1, args.world_size).item(), images.size(0))
        top5.update(reduce_tensor(prec5, args.world_size).item(), images.size(0))
    if args.rank == 0:
        print(f" * Prec@1 {top1.avg:.3f} Prec@5 {top5.avg:.3f}")
    return top1.avg


def save_checkpoint(state, is_best, filename="checkpoint.pth.tar"):
    torch.save(state, filename)
    if is_best:
        shutil.copyfile(filename, "model_best.pth.tar")


def main():
    args = parse()
    cudnn.benchmark = True
    best_prec1 = 0

    args.distributed = int(os.environ.get("WORLD_SIZE", 1)) > 1
    args.gpu = 0
    args.world_size = 1
    args.rank = 0
    if args.distributed:
        args.gpu = args.local_rank
        torch.cuda.set_device(args.gpu)
        dist.init_process_group(backend="nccl", init_method="env://")
        args.world_size = dist.get_world_size()
        args.rank = dist.get_rank()

    if args.pretrained:
        model = models.__dict__[args.arch](weights="DEFAULT")
    else:
        model = models.__dict__[args.arch]()
    if args.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.cuda()
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)

    # Scale learning rate based on global batch size
    args.lr = args.lr * float(args.batch_size * args.world_size) / 256.
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)

    if args.resume and os.path.isfile(args.resume):
        checkpoint = torch.load(args.resume, map_location=lambda storage, loc: storage.cuda(args.gpu))
        args.start_epoch = checkpoint["epoch"]
        best_prec1 = checkpoint["best_prec1"]
        model.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])

    if args.distributed:
        model = DDP(model, device_ids=[args.gpu])

    criterion = nn.CrossEntropyLoss().cuda()

    traindir = os.path.join(args.data, "train")
    valdir = os.path.join(args.data, "val")
    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_dataset = datasets.ImageFolder(traindir, transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), normalize]))
    val_dataset = datasets.ImageFolder(valdir, transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), normalize]))

    train_sampler = None
    val_sampler = None
    if args.distributed:
        train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset)
        val_sampler = torch.utils.data.distributed.DistributedSampler(val_dataset, shuffle=False)

    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, shuffle=(train_sampler is None),
        num_workers=args.workers, pin_memory=True, sampler=train_sampler, drop_last=True)
    val_loader = torch.utils.data.DataLoader(
        val_dataset, batch_size=args.batch_size, shuffle=False,
        num_workers=args.workers, pin_memory=True, sampler=val_sampler)

    if args.evaluate:
        validate(val_loader, model, criterion, args)
        args.epochs = args.start_epoch

    for epoch in range(args.start_epoch, args.epochs):
        if args.distributed:
            train_sampler.set_epoch(epoch)
        train(train_loader, model, criterion, optimizer, scaler, epoch, args)
        prec1 = validate(val_loader, model, criterion, args)

        if args.rank == 0:
            is_best = prec1 > best_prec1
            best_prec1 = max(prec1, best_prec1)
            save_checkpoint({
                "epoch": epoch + 1,
                "arch": args.arch,
                "state_dict": model.module.state_dict() if args.distributed else model.state_dict(),
                "best_prec1": best_prec1,
                "optimizer": optimizer.state_dict(),
            }, is_best)

    if args.distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
