#!/usr/bin/env python
# ResNet-50 / LAMB ImageNet benchmark, CUDA-stream prefetcher input path.
# Derived from the apex imagenet example; uses native AMP instead of apex.amp.
#
#   torchrun --nproc_per_node=8 16_rn50_lamb_prefetcher.py /data/imagenet -b 256 --epochs 90
import argparse
import os
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.data
import torch.utils.data.distributed
import torchvision.datasets as datasets
import torchvision.models as models
import torchvision.transforms as transforms
from torch.nn.parallel import DistributedDataParallel as DDP

from apex.optimizers import FusedLAMB


def parse():
    parser = argparse.ArgumentParser(description="PyTorch ImageNet LAMB Training")
    parser.add_argument("data", metavar="DIR")
    parser.add_argument("--arch", "-a", default="resnet50")
    parser.add_argument("-j", "--workers", default=8, type=int)
    parser.add_argument("--epochs", default=90, type=int)
    parser.add_argument("-b", "--batch-size", default=256, type=int, help="per process")
    parser.add_argument("--lr", default=2e-3, type=float, help="for 1024 images")
    parser.add_argument("--weight-decay", default=0.01, type=float)
    parser.add_argument("--warmup", default=5, type=int)
    parser.add_argument("--print-freq", "-p", default=100, type=int)
    parser.add_argument("--resume", default="", type=str)
    parser.add_argument("--save-dir", default="./ckpt_rn50_lamb")
    parser.add_argument("--channels-last", type=bool, default=True)
    parser.add_argument("--local_rank", default=0, type=int)
    return parser.parse_args()


def fast_collate(batch, memory_format):
    imgs = [img[0] for img in batch]
    targets = torch.tensor([target[1] for target in batch], dtype=torch.int64)
    w, h = imgs[0].size[0], imgs[0].size[1]
    tensor = torch.zeros((len(imgs), 3, h, w), dtype=torch.uint8).contiguous(memory_format=memory_format)
    for i, img in enumerate(imgs):
        nump_array = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy())
        if nump_array.ndim < 3:
            nump_array = nump_array.unsqueeze(-1)
        tensor[i] += nump_array.permute(2, 0, 1)
    return tensor, targets


class DataPrefetcher:
    def __init__(self, loader):
        self.loader = iter(loader)
        self.stream = torch.cuda.Stream()
        self.mean = torch.tensor([0.485 * 255, 0.456 * 255, 0.406 * 255]).cuda().view(1, 3, 1, 1)
        self.std = torch.tensor([0.229 * 255, 0.224 * 255, 0.225 * 255]).cuda().view(1, 3, 1, 1)
        self.preload()

    def preload(self):
        try:
            self.next_input, self.next_target = next(self.loader)
        except StopIteration:
            self.next_input = None
            self.next_target = None
            return
        with torch.cuda.stream(self.stream):
            self.next_input = self.next_input.cuda(non_blocking=True)
            self.next_target = self.next_target.cuda(non_blocking=True)
            self.next_input = self.next_input.float().sub_(self.mean).div_(self.std)

    def next(self):
        torch.cuda.current_stream().wait_stream(self.stream)
        inp, target = self.next_input, self.next_target
        if inp is not None:
            inp.record_stream(torch.cuda.current_stream())
            target.record_stream(torch.cuda.current_stream())
        self.preload()
        return inp, target


def adjust_learning_rate(optimizer, epoch, step, len_epoch, args, peak):
    if epoch < args.warmup:
        lr = peak * float(1 + step + epoch * len_epoch) / (args.warmup * len_epoch)
    else:
        factor = epoch // 30
        lr = peak * (0.1 ** factor)
    for g in optimizer.param_groups:
        g["lr"] = lr
    return lr


def validate(val_loader, model, world_size):
    model.eval()
    stats = torch.zeros(2, device="cuda")
    prefetcher = DataPrefetcher(val_loader)
    inp, target = prefetcher.next()
    while inp is not None:
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            out = model(inp)
        stats[0] += (out.argmax(1) == target).sum()
        stats[1] += target.numel()
        inp, target = prefetcher.next()
    dist.all_reduce(stats)
    return (100.0 * stats[0] / stats[1]).item()


def main():
    args = parse()
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format

    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    torch.backends.cudnn.benchmark = True

    model = models.__dict__[args.arch]()
    model = model.cuda().to(memory_format=memory_format)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    peak_lr = args.lr * args.batch_size * world_size / 1024.0
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim == 1 else decay).append(p)
    optimizer = FusedLAMB([{"params": decay, "weight_decay": args.weight_decay},
                           {"params": no_decay, "weight_decay": 0.0}], lr=peak_lr)
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.CrossEntropyLoss().cuda()

    start_epoch = 0
    best_prec1 = 0.0
    if args.resume and os.path.isfile(args.resume):
        checkpoint = torch.load(args.resume, map_location=lambda storage, loc: storage.cuda(args.local_rank))
        start_epoch = checkpoint["epoch"]
        best_prec1 = checkpoint["best_prec1"]
        model.module.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])

    traindir = os.path.join(args.data, "train")
    valdir = os.path.join(args.data, "val")
    train_dataset = datasets.ImageFolder(traindir, transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip()]))
    val_dataset = datasets.ImageFolder(valdir, transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224)]))
    train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset)
    val_sampler = torch.utils.data.distributed.DistributedSampler(val_dataset, shuffle=False)
    collate = lambda b: fast_collate(b, memory_format)  # noqa: E731
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, shuffle=False, num_workers=args.workers,
        pin_memory=True, sampler=train_sampler, collate_fn=collate, drop_last=True)
    val_loader = torch.utils.data.DataLoader(
        val_dataset, batch_size=args.batch_size, shuffle=False, num_workers=args.workers,
        pin_memory=True, sampler=val_sampler, collate_fn=collate)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    len_epoch = len(train_loader)
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        end = time.time()
        prefetcher = DataPrefetcher(train_loader)
        inp, target = prefetcher.next()
        i = 0
        while inp is not None:
            lr = adjust_learning_rate(optimizer, epoch, i, len_epoch, args, peak_lr)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(model(inp), target)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if i % args.print_freq == 0 and rank == 0:
                torch.cuda.synchronize()
                batch_time = (time.time() - end) / (args.print_freq if i else 1)
                end = time.time()
                print(f"Epoch [{epoch}][{i}/{len_epoch}] loss {loss.item():.4f} lr {lr:.5f} "
                      f"speed {world_size * args.batch_size / batch_time:.1f} img/s", flush=True)
            i += 1
            inp, target = prefetcher.next()

        prec1 = validate(val_loader, model, world_size)
        if rank == 0:
            is_best = prec1 > best_prec1
            best_prec1 = max(prec1, best_prec1)
            print(f" * Prec@1 {prec1:.3f} (best {best_prec1:.3f})", flush=True)
            path = os.path.join(args.save_dir, "checkpoint.pth.tar")
            torch.save({"epoch": epoch + 1, "arch": args.arch, "state_dict": model.module.state_dict(),
                        "best_prec1": best_prec1, "optimizer": optimizer.state_dict()}, path)
            if is_best:
                shutil.copyfile(path, os.path.join(args.save_dir, "model_best.pth.tar"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
