"""ResNet-101 ImageNet training, one process per GPU started with mp.spawn.

Multi-node: run once per node with the same --dist-url and --world-size (number
of nodes) and --rank = node index.
"""
import argparse
import datetime
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from torchvision.datasets.folder import default_loader

from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy

parser = argparse.ArgumentParser(description="ResNet-101 ImageNet")
parser.add_argument("data", metavar="DIR")
parser.add_argument("--arch", default="resnet101")
parser.add_argument("--epochs", default=200, type=int)
parser.add_argument("--warmup-epochs", default=5, type=int)
parser.add_argument("-b", "--batch-size", default=1024, type=int,
                    help="total batch size of all GPUs on all nodes")
parser.add_argument("--lr", default=0.1, type=float, help="lr per 256 images")
parser.add_argument("--wd", default=5e-5, type=float)
parser.add_argument("--label-smoothing", default=0.1, type=float)
parser.add_argument("--cutmix", default=1.0, type=float)
parser.add_argument("--ema-decay", default=0.9999, type=float)
parser.add_argument("-j", "--workers", default=6, type=int, help="data loading workers per process")
parser.add_argument("--world-size", default=1, type=int, help="number of nodes")
parser.add_argument("--rank", default=0, type=int, help="node rank")
parser.add_argument("--dist-url", default="tcp://127.0.0.1:23456", type=str)
parser.add_argument("--output", default="/shared/ckpt/r101", type=str)
parser.add_argument("--index-cache", default="/shared/cache/imagenet_index.json", type=str)
parser.add_argument("--resume", default="", type=str)


class IndexedImageFolder(Dataset):
    """ImageFolder that reads its file list from a JSON index instead of walking 1.3M files."""

    def __init__(self, index, split, transform):
        self.samples = [(os.path.join(index["root"], p), c) for p, c in index[split]]
        self.transform = transform

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, target = self.samples[i]
        return self.transform(default_loader(path)), target


def build_index(root):
    index = {"root": root}
    for split in ("train", "val"):
        classes = sorted(d.name for d in os.scandir(os.path.join(root, split)) if d.is_dir())
        items = []
        for c, name in enumerate(classes):
            for f in sorted(os.listdir(os.path.join(root, split, name))):
                items.append((os.path.join(split, name, f), c))
        index[split] = items
    return index


def load_index(args, global_rank):
    # one process builds the index on shared storage; everyone else waits for it
    if global_rank == 0 and not os.path.exists(args.index_cache):
        index = build_index(args.data)
        os.makedirs(os.path.dirname(args.index_cache), exist_ok=True)
        tmp = args.index_cache + ".tmp"
        with open(tmp, "w") as f:
            json.dump(index, f)
        os.replace(tmp, args.index_cache)
    dist.barrier()
    with open(args.index_cache) as f:
        return json.load(f)


def main():
    args = parser.parse_args()
    ngpus_per_node = torch.cuda.device_count()
    mp.spawn(main_worker, nprocs=ngpus_per_node, args=(ngpus_per_node, args))


def main_worker(gpu, ngpus_per_node, args):
    node_rank = args.rank
    world_size = args.world_size * ngpus_per_node
    rank = node_rank * ngpus_per_node + gpu
    torch.cuda.set_device(gpu)
    # generous timeout: the first run scans the whole train tree before the first barrier returns
    dist.init_process_group(backend="nccl", init_method=args.dist_url, world_size=world_size, rank=rank,
                            timeout=datetime.timedelta(minutes=90))
    device = torch.device("cuda", gpu)
    per_gpu_batch = args.batch_size // world_size
    workers = args.workers

    model = torchvision.models.__dict__[args.arch](weights=None, num_classes=1000)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.cuda(gpu).to(memory_format=torch.channels_last)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[gpu])
    # build the EMA from the DDP-synchronised weights, not from this rank's own random init
    ema = AveragedModel(model.module, multi_avg_fn=get_ema_multi_avg_fn(args.ema_decay), use_buffers=True)

    lr = args.lr * args.batch_size / 256
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim <= 1 else decay).append(p)
    optimizer = torch.optim.SGD([{"params": decay, "weight_decay": args.wd},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=lr, momentum=0.9, nesterov=True)

    index = load_index(args, rank)
    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_set = IndexedImageFolder(index, "train", transforms.Compose([
        transforms.RandomResizedCrop(176), transforms.RandomHorizontalFlip(),
        transforms.TrivialAugmentWide(), transforms.ToTensor(), normalize,
        transforms.RandomErasing(p=0.1)]))
    val_set = IndexedImageFolder(index, "val", transforms.Compose([
        transforms.Resize(232), transforms.CenterCrop(224), transforms.ToTensor(), normalize]))
    val_set.samples = val_set.samples[rank::world_size]

    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank)
    train_loader = DataLoader(train_set, batch_size=per_gpu_batch, sampler=train_sampler,
                              num_workers=workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=128, shuffle=False, num_workers=workers, pin_memory=True)

    steps_per_epoch = len(train_loader)
    total_steps = args.epochs * steps_per_epoch
    warmup_steps = args.warmup_epochs * steps_per_epoch

    def lr_lambda(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return 0.5 * (1 + math.cos(math.pi * (step - warmup_steps) / (total_steps - warmup_steps)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    mixup = Mixup(cutmix_alpha=args.cutmix, mixup_alpha=0.2, label_smoothing=args.label_smoothing,
                  num_classes=1000)
    criterion = SoftTargetCrossEntropy()
    scaler = torch.cuda.amp.GradScaler()

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=f"cuda:{gpu}")
        model.module.load_state_dict(ckpt["state_dict"])
        ema.load_state_dict(ckpt["ema"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"] + 1
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        print(f"world_size={world_size} per_gpu_batch={per_gpu_batch} lr={lr}")

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        end = time.time()
        for i, (images, target) in enumerate(train_loader):
            images = images.cuda(gpu, non_blocking=True).to(memory_format=torch.channels_last)
            target = target.cuda(gpu, non_blocking=True)
            images, soft = mixup(images, target)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(model(images), soft)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            ema.update_parameters(model.module)
            if rank == 0 and i % 100 == 0:
                print(f"Epoch [{epoch}][{i}/{steps_per_epoch}] loss {loss.item():.3f} "
                      f"lr {scheduler.get_last_lr()[0]:.4f} {time.time() - end:.2f}s/it")
            end = time.time()

        res = torch.zeros(3, device=device)
        for net_idx, net in enumerate((model.module, ema.module)):
            net.eval()
            with torch.no_grad():
                for images, target in val_loader:
                    images = images.cuda(gpu, non_blocking=True)
                    target = target.cuda(gpu, non_blocking=True)
                    with torch.autocast("cuda", dtype=torch.float16):
                        pred = net(images).argmax(1)
                    res[net_idx] += (pred == target).sum()
                    if net_idx == 0:
                        res[2] += target.numel()
        dist.all_reduce(res)
        if rank == 0:
            print(f"Epoch {epoch}: acc1 {100 * res[0] / res[2]:.2f} ema acc1 {100 * res[1] / res[2]:.2f}")
            torch.save({"epoch": epoch, "arch": args.arch, "state_dict": model.module.state_dict(),
                        "ema": ema.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict()},
                       os.path.join(args.output, "checkpoint.pth.tar"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
