import argparse
import os
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.data
import torchvision.datasets as datasets
import torchvision.models as models
import torchvision.transforms as transforms
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler


def get_args():
    parser = argparse.ArgumentParser("ImageNet training with a CUDA-stream prefetcher")
    parser.add_argument("data", metavar="DIR")
    parser.add_argument("-a", "--arch", default="resnet50")
    parser.add_argument("-j", "--workers", default=8, type=int)
    parser.add_argument("--epochs", default=90, type=int)
    parser.add_argument("-b", "--batch-size", default=128, type=int, help="per process")
    parser.add_argument("--lr", default=0.1, type=float, help="per 256 images")
    parser.add_argument("--momentum", default=0.9, type=float)
    parser.add_argument("--weight-decay", default=1e-4, type=float)
    parser.add_argument("--print-freq", default=100, type=int)
    parser.add_argument("--save-dir", default="runs/prefetch")
    parser.add_argument("--channels-last", action="store_true")
    return parser.parse_args()


def fast_collate(batch, memory_format=torch.contiguous_format):
    imgs = [img[0] for img in batch]
    targets = torch.tensor([target[1] for target in batch], dtype=torch.int64)
    w, h = imgs[0].size[0], imgs[0].size[1]
    tensor = torch.zeros((len(imgs), 3, h, w), dtype=torch.uint8).contiguous(memory_format=memory_format)
    for i, img in enumerate(imgs):
        nump_array = np.asarray(img, dtype=np.uint8)
        if nump_array.ndim < 3:
            nump_array = np.expand_dims(nump_array, axis=-1)
        nump_array = np.rollaxis(nump_array, 2)
        tensor[i] += torch.from_numpy(nump_array)
    return tensor, targets


class DataPrefetcher:
    """Copies the next batch to the GPU on a side stream while the current one runs."""

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


def adjust_learning_rate(optimizer, epoch, step, len_epoch, base_lr):
    factor = epoch // 30
    if epoch >= 80:
        factor = factor + 1
    lr = base_lr * (0.1 ** factor)
    if epoch < 5:
        lr = lr * float(1 + step + epoch * len_epoch) / (5.0 * len_epoch)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr


def reduce_mean(t, world_size):
    rt = t.clone()
    dist.all_reduce(rt, op=dist.ReduceOp.SUM)
    return rt / world_size


def train(loader, model, criterion, optimizer, epoch, args, base_lr, world_size, rank):
    model.train()
    prefetcher = DataPrefetcher(loader)
    inp, target = prefetcher.next()
    i = 0
    end = time.time()
    while inp is not None:
        adjust_learning_rate(optimizer, epoch, i, len(loader), base_lr)
        if args.channels_last:
            inp = inp.contiguous(memory_format=torch.channels_last)
        output = model(inp)
        loss = criterion(output, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

        if i % args.print_freq == 0:
            reduced_loss = reduce_mean(loss.data, world_size)
            torch.cuda.synchronize()
            if rank == 0:
                speed = world_size * args.batch_size * args.print_freq / (time.time() - end)
                print(f"Epoch [{epoch}][{i}/{len(loader)}] loss {reduced_loss.item():.4f} speed {speed:.1f} img/s")
            end = time.time()
        i += 1
        inp, target = prefetcher.next()


@torch.no_grad()
def validate(loader, model, world_size):
    model.eval()
    correct = torch.zeros((), device="cuda")
    seen = torch.zeros((), device="cuda")
    prefetcher = DataPrefetcher(loader)
    inp, target = prefetcher.next()
    while inp is not None:
        output = model(inp)
        correct += (output.argmax(dim=1) == target).sum()
        seen += target.size(0)
        inp, target = prefetcher.next()
    dist.all_reduce(correct)
    dist.all_reduce(seen)
    return (100.0 * correct / seen).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    torch.backends.cudnn.benchmark = True

    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    model = models.__dict__[args.arch]().cuda().to(memory_format=memory_format)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    criterion = nn.CrossEntropyLoss().cuda()

    base_lr = args.lr * float(args.batch_size * world_size) / 256.0
    optimizer = torch.optim.SGD(model.parameters(), base_lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)

    traindir = os.path.join(args.data, "train")
    valdir = os.path.join(args.data, "val")
    train_dataset = datasets.ImageFolder(traindir, transforms.Compose([
        transforms.RandomResizedCrop(224),
        transforms.RandomHorizontalFlip(),
    ]))
    val_dataset = datasets.ImageFolder(valdir, transforms.Compose([
        transforms.Resize(256),
        transforms.CenterCrop(224),
    ]))

    train_sampler = DistributedSampler(train_dataset, shuffle=True, drop_last=True)
    # strided split of the val set: no padded duplicates, every image counted once
    val_subset = torch.utils.data.Subset(val_dataset, list(range(rank, len(val_dataset), world_size)))
    collate = lambda b: fast_collate(b, memory_format)
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, sampler=train_sampler,
        num_workers=args.workers, pin_memory=True, collate_fn=collate, drop_last=True,
        persistent_workers=True)
    val_loader = torch.utils.data.DataLoader(
        val_subset, batch_size=args.batch_size, shuffle=False,
        num_workers=args.workers, pin_memory=True, collate_fn=collate)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
    best_prec1 = 0.0
    for epoch in range(args.epochs):
        train(train_loader, model, criterion, optimizer, epoch, args, base_lr, world_size, rank)
        prec1 = validate(val_loader, model.module, world_size)
        if rank == 0:
            is_best = prec1 > best_prec1
            best_prec1 = max(prec1, best_prec1)
            print(f" * Epoch {epoch} Prec@1 {prec1:.3f} (best {best_prec1:.3f})")
            path = os.path.join(args.save_dir, "checkpoint.pth.tar")
            torch.save({"epoch": epoch + 1, "arch": args.arch, "state_dict": model.module.state_dict(),
                        "best_prec1": best_prec1, "optimizer": optimizer.state_dict()}, path)
            if is_best:
                shutil.copyfile(path, os.path.join(args.save_dir, "model_best.pth.tar"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
