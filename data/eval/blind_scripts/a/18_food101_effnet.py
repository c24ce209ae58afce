"""EfficientNet-B0 on Food-101 (torchvision dataset), DDP + AMP, torchvision-references style logging.

    torchrun --nproc_per_node=4 train_food101.py --data-path /datasets --epochs 30
"""
import argparse
import datetime
import os
import time
from collections import defaultdict, deque

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision.transforms import v2 as T


class SmoothedValue:
    """Tracks a series of values and gives access to smoothed values over a window or the global average."""

    def __init__(self, window_size=20):
        self.deque = deque(maxlen=window_size)
        self.total = 0.0
        self.count = 0

    def update(self, value, n=1):
        self.deque.append(value)
        self.count += n
        self.total += value * n

    def synchronize_between_processes(self):
        t = torch.tensor([self.count, self.total], dtype=torch.float64)
        dist.barrier()
        dist.all_reduce(t)
        t = t.tolist()
        self.count = int(t[0])
        self.total = t[1]

    @property
    def avg(self):
        return sum(self.deque) / max(len(self.deque), 1)

    @property
    def global_avg(self):
        return self.total / max(self.count, 1)


class MetricLogger:
    def __init__(self):
        self.meters = defaultdict(SmoothedValue)

    def update(self, n=1, **kwargs):
        for k, v in kwargs.items():
            self.meters[k].update(v.item() if torch.is_tensor(v) else v, n)

    def synchronize_between_processes(self):
        for meter in self.meters.values():
            meter.synchronize_between_processes()

    def __str__(self):
        return "  ".join(f"{k}: {m.avg:.4f} ({m.global_avg:.4f})" for k, m in self.meters.items())


def is_main():
    return dist.get_rank() == 0


def train_one_epoch(model, criterion, optimizer, scaler, loader, device, epoch, print_freq):
    model.train()
    logger = MetricLogger()
    start = time.time()
    for i, (image, target) in enumerate(loader):
        image, target = image.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            output = model(image)
            loss = criterion(output, target)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        acc1 = (output.argmax(1) == target).float().mean() * 100
        logger.update(n=image.size(0), loss=loss, acc1=acc1)
        if i % print_freq == 0 and is_main():
            print(f"Epoch [{epoch}] [{i}/{len(loader)}]  {logger}  lr: {optimizer.param_groups[0]['lr']:.5f}")
    logger.synchronize_between_processes()
    if is_main():
        print(f"Epoch [{epoch}] done in {datetime.timedelta(seconds=int(time.time() - start))}  "
              f"train loss {logger.meters['loss'].global_avg:.4f} acc@1 {logger.meters['acc1'].global_avg:.2f}")


@torch.no_grad()
def evaluate(model, criterion, loader, device):
    model.eval()
    logger = MetricLogger()
    for image, target in loader:
        image, target = image.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            output = model(image)
            loss = criterion(output, target)
        acc1 = (output.argmax(1) == target).float().mean() * 100
        logger.update(n=image.size(0), loss=loss, acc1=acc1)
    logger.synchronize_between_processes()
    return logger.meters["acc1"].global_avg


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-path", default="/datasets")
    p.add_argument("--output-dir", default="out/food101_b0")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("-b", "--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--lr", type=float, default=0.05, help="for a global batch of 256")
    p.add_argument("--wd", type=float, default=1e-5)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--print-freq", type=int, default=50)
    return p.parse_args()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    train_tf = T.Compose([T.RandomResizedCrop(224, antialias=True), T.RandomHorizontalFlip(),
                          T.TrivialAugmentWide(), T.PILToTensor(), T.ToDtype(torch.float32, scale=True),
                          T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    val_tf = T.Compose([T.Resize(256, antialias=True), T.CenterCrop(224), T.PILToTensor(),
                        T.ToDtype(torch.float32, scale=True),
                        T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    if rank == 0:
        torchvision.datasets.Food101(args.data_path, split="train", download=True)
        torchvision.models.efficientnet_b0(weights="IMAGENET1K_V1")  # fill the hub cache once
    dist.barrier()
    train_ds = torchvision.datasets.Food101(args.data_path, split="train", transform=train_tf)
    val_ds = torchvision.datasets.Food101(args.data_path, split="test", transform=val_tf)
    val_ds = torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world))

    train_sampler = DistributedSampler(train_ds)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=128, num_workers=args.workers, pin_memory=True)

    model = torchvision.models.efficientnet_b0(weights="IMAGENET1K_V1")
    model.classifier[1] = nn.Linear(model.classifier[1].in_features, 101)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])

    lr = args.lr * args.batch_size * world / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=args.wd)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    scaler = torch.cuda.amp.GradScaler()

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        train_one_epoch(model, criterion, optimizer, scaler, train_loader, device, epoch, args.print_freq)
        scheduler.step()
        acc = evaluate(model, criterion, val_loader, device)
        if is_main():
            print(f"Test: acc@1 {acc:.2f}")
            os.makedirs(args.output_dir, exist_ok=True)
            ckpt = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "epoch": epoch}
            torch.save(ckpt, os.path.join(args.output_dir, "checkpoint.pth"))
            if acc > best:
                best = acc
                torch.save(ckpt, os.path.join(args.output_dir, "model_best.pth"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
