"""ResNet-50 ImageNet training adapted from pytorch/examples/imagenet.

Adds label smoothing, cutmix/mixup, cosine schedule with linear warmup, AMP and
an EMA copy of the weights. One process per GPU, started by mp.spawn on every node:

    node0$ python 13_resnet50_examples.py /data/imagenet --dist-url tcp://10.1.0.11:23456 \
               --world-size 2 --rank 0
    node1$ python 13_resnet50_examples.py /data/imagenet --dist-url tcp://10.1.0.11:23456 \
               --world-size 2 --rank 1
"""
import argparse
import math
import os
import shutil
import time

import torch
import torch.backends.cudnn as cudnn
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.optim
import torch.utils.data
import torch.utils.data.distributed
import torchvision.datasets as datasets
import torchvision.models as models
import torchvision.transforms as transforms
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy
from timm.utils import ModelEmaV2

parser = argparse.ArgumentParser(description="PyTorch ImageNet Training")
parser.add_argument("data", metavar="DIR", help="path to dataset")
parser.add_argument("-a", "--arch", default="resnet50")
parser.add_argument("-j", "--workers", default=8, type=int)
parser.add_argument("--epochs", default=120, type=int)
parser.add_argument("--warmup-epochs", default=5, type=int)
parser.add_argument("--start-epoch", default=0, type=int)
parser.add_argument("-b", "--batch-size", default=128, type=int, help="mini-batch size per GPU")
parser.add_argument("--lr", "--learning-rate", default=0.1, type=float, help="lr per 256 images")
parser.add_argument("--momentum", default=0.9, type=float)
parser.add_argument("--wd", "--weight-decay", default=1e-4, type=float, dest="weight_decay")
parser.add_argument("--label-smoothing", default=0.1, type=float)
parser.add_argument("--mixup-alpha", default=0.2, type=float)
parser.add_argument("--cutmix-alpha", default=1.0, type=float)
parser.add_argument("--ema-decay", default=0.9999, type=float)
parser.add_argument("-p", "--print-freq", default=100, type=int)
parser.add_argument("--resume", default="", type=str)
parser.add_argument("--world-size", default=1, type=int, help="number of nodes for distributed training")
parser.add_argument("--rank", default=0, type=int, help="node rank for distributed training")
parser.add_argument("--dist-url", default="tcp://127.0.0.1:23456", type=str)
parser.add_argument("--dist-backend", default="nccl", type=str)
parser.add_argument("--ckpt-dir", default="/nfs/ckpt/resnet50_in1k", type=str)


def main():
    args = parser.parse_args()
    ngpus_per_node = torch.cuda.device_count()
    mp.spawn(main_worker, nprocs=ngpus_per_node, args=(ngpus_per_node, args))


def main_worker(gpu, ngpus_per_node, args):
    args.gpu = gpu
    # global rank = node rank * gpus per node + local gpu index
    args.rank = args.rank * ngpus_per_node + gpu
    torch.cuda.set_device(args.gpu)
    dist.init_process_group(backend=args.dist_backend, init_method=args.dist_url,
                            world_size=args.world_size, rank=args.rank)
    world_size = dist.get_world_size()
    print(f"Use GPU {args.gpu}, global rank {args.rank}/{world_size}")

    model = models.__dict__[args.arch](weights=None)
    model.cuda(args.gpu)
    model = model.to(memory_format=torch.channels_last)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
    model_ema = ModelEmaV2(model.module, decay=args.ema_decay)

    lr = args.lr * args.batch_size * world_size / 256
    params_bn = [p for n, p in model.named_parameters() if p.ndim == 1]
    params_w = [p for n, p in model.named_parameters() if p.ndim > 1]
    optimizer = torch.optim.SGD([{"params": params_w, "weight_decay": args.weight_decay},
                                 {"params": params_bn, "weight_decay": 0.0}],
                                lr, momentum=args.momentum, nesterov=True)
    criterion = SoftTargetCrossEntropy().cuda(args.gpu)
    scaler = torch.cuda.amp.GradScaler()

    if args.resume and os.path.isfile(args.resume):
        loc = f"cuda:{args.gpu}"
        checkpoint = torch.load(args.resume, map_location=loc)
        args.start_epoch = checkpoint["epoch"]
        model.module.load_state_dict(checkpoint["state_dict"])
        model_ema.module.load_state_dict(checkpoint["ema"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scaler.load_state_dict(checkpoint["scaler"])
        print(f"=> loaded checkpoint '{args.resume}' (epoch {checkpoint['epoch']})")
    cudnn.benchmark = True

    traindir = os.path.join(args.data, "train")
    valdir = os.path.join(args.data, "val")
    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_dataset = datasets.ImageFolder(traindir, transforms.Compose([
        transforms.RandomResizedCrop(224),
        transforms.RandomHorizontalFlip(),
        transforms.AutoAugment(transforms.AutoAugmentPolicy.IMAGENET),
        transforms.ToTensor(),
        normalize,
    ]))
    val_dataset = datasets.ImageFolder(valdir, transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), normalize]))
    val_subset = torch.utils.data.Subset(val_dataset, range(args.rank, len(val_dataset), world_size))

    train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset)
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, shuffle=False, num_workers=args.workers,
        pin_memory=True, sampler=train_sampler, drop_last=True)
    val_loader = torch.utils.data.DataLoader(
        val_subset, batch_size=args.batch_size, shuffle=False, num_workers=args.workers, pin_memory=True)

    mixup = Mixup(mixup_alpha=args.mixup_alpha, cutmix_alpha=args.cutmix_alpha,
                  label_smoothing=args.label_smoothing, num_classes=1000)
    iters_per_epoch = len(train_loader)
    total_iters = args.epochs * iters_per_epoch
    warmup_iters = args.warmup_epochs * iters_per_epoch

    def set_lr(it):
        if it < warmup_iters:
            cur = lr * (it + 1) / warmup_iters
        else:
            cur = 0.5 * lr * (1 + math.cos(math.pi * (it - warmup_iters) / (total_iters - warmup_iters)))
        for g in optimizer.param_groups:
            g["lr"] = cur
        return cur

    best_acc1 = 0.0
    if args.rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
    for epoch in range(args.start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        end = time.time()
        for i, (images, target) in enumerate(train_loader):
            cur_lr = set_lr(epoch * iters_per_epoch + i)
            images = images.cuda(args.gpu, non_blocking=True).to(memory_format=torch.channels_last)
            target = target.cuda(args.gpu, non_blocking=True)
            images, soft_target = mixup(images, target)
            with torch.autocast("cuda", dtype=torch.float16):
                output = model(images)
                loss = criterion(output, soft_target)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            model_ema.update(model.module)
            if args.rank == 0 and i % args.print_freq == 0:
                print(f"Epoch: [{epoch}][{i}/{iters_per_epoch}]\tLoss {loss.item():.4f}\tLR {cur_lr:.4f}\t"
                      f"Time {time.time() - end:.3f}")
            end = time.time()

        acc1 = validate(val_loader, model.module, args)
        ema_acc1 = validate(val_loader, model_ema.module, args)
        is_best = ema_acc1 > best_acc1
        best_acc1 = max(ema_acc1, best_acc1)
        if args.rank == 0:
            print(f" * Epoch {epoch} Acc@1 {acc1:.3f}  EMA Acc@1 {ema_acc1:.3f}")
            save_checkpoint({"epoch": epoch + 1, "arch": args.arch, "state_dict": model.module.state_dict(),
                             "ema": model_ema.module.state_dict(), "best_acc1": best_acc1,
                             "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()},
                            is_best, args.ckpt_dir)

    dist.destroy_process_group()


@torch.no_grad()
def validate(val_loader, model, args):
    model.eval()
    correct = torch.zeros(2, device=f"cuda:{args.gpu}")
    for images, target in val_loader:
        images = images.cuda(args.gpu, non_blocking=True).to(memory_format=torch.channels_last)
        target = target.cuda(args.gpu, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            output = model(images)
        correct[0] += (output.argmax(dim=1) == target).sum()
        correct[1] += target.size(0)
    dist.all_reduce(correct, dist.ReduceOp.SUM)
    return 100.0 * (correct[0] / correct[1]).item()


def save_checkpoint(state, is_best, ckpt_dir, filename="checkpoint.pth.tar"):
    path = os.path.join(ckpt_dir, filename)
    torch.save(state, path)
    if is_best:
        shutil.copyfile(path, os.path.join(ckpt_dir, "model_best.pth.tar"))


if __name__ == "__main__":
    main()
