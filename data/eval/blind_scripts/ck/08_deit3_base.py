"""DeiT III style ViT-B training (BCE loss, LayerScale, 3-Augment-like pipeline)."""
import argparse
import datetime
import json
import os
import time
from collections import defaultdict, deque
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import datasets, transforms

import timm
from timm.data import Mixup, create_transform
from timm.loss import BinaryCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import CosineLRScheduler
from timm.utils import ModelEmaV2, NativeScaler, accuracy


class SmoothedValue:
    def __init__(self, window_size=20):
        self.deque = deque(maxlen=window_size)
        self.total = 0.0
        self.count = 0

    def update(self, value, n=1):
        self.deque.append(value)
        self.count += n
        self.total += value * n

    def synchronize_between_processes(self):
        t = torch.tensor([self.count, self.total], dtype=torch.float64, device="cuda")
        dist.barrier()
        dist.all_reduce(t)
        self.count = int(t[0].item())
        self.total = t[1].item()

    @property
    def global_avg(self):
        return self.total / max(self.count, 1)

    @property
    def median(self):
        return torch.tensor(list(self.deque)).median().item()


class MetricLogger:
    def __init__(self):
        self.meters = defaultdict(SmoothedValue)

    def update(self, n=1, **kwargs):
        for k, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                v = v.item()
            self.meters[k].update(v, n=n)

    def synchronize_between_processes(self):
        for meter in self.meters.values():
            meter.synchronize_between_processes()

    def __str__(self):
        return "  ".join(f"{k}: {m.median:.4f} ({m.global_avg:.4f})" for k, m in self.meters.items())


def get_args():
    p = argparse.ArgumentParser("DeiT III training")
    p.add_argument("--model", default="deit3_base_patch16_224")
    p.add_argument("--data-path", default="/datasets/imagenet")
    p.add_argument("--output-dir", default="/checkpoint/deit3_base")
    p.add_argument("--batch-size", default=64, type=int)
    p.add_argument("--epochs", default=400, type=int)
    p.add_argument("--lr", default=3e-3, type=float, help="for a global batch of 2048")
    p.add_argument("--weight-decay", default=0.02, type=float)
    p.add_argument("--warmup-epochs", default=5, type=int)
    p.add_argument("--drop-path", default=0.2, type=float)
    p.add_argument("--clip-grad", default=1.0, type=float)
    p.add_argument("--cutmix", default=1.0, type=float)
    p.add_argument("--smoothing", default=0.0, type=float)
    p.add_argument("--ema-decay", default=0.99996, type=float)
    p.add_argument("--eval-every", default=5, type=int)
    p.add_argument("--num-workers", default=10, type=int)
    p.add_argument("--resume", default="")
    return p.parse_args()


def train_one_epoch(model, criterion, loader, optimizer, epoch, scaler, clip_grad, ema, mixup_fn, rank):
    model.train()
    logger = MetricLogger()
    for it, (samples, targets) in enumerate(loader):
        samples = samples.cuda(non_blocking=True)
        targets = targets.cuda(non_blocking=True)
        samples, targets = mixup_fn(samples, targets)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = criterion(model(samples), targets)
        optimizer.zero_grad()
        scaler(loss, optimizer, clip_grad=clip_grad, parameters=model.parameters())
        ema.update(model.module)
        logger.update(loss=loss.item(), lr=optimizer.param_groups[0]["lr"])
        if rank == 0 and it % 200 == 0:
            print(f"Epoch [{epoch}] [{it}/{len(loader)}] {logger}")
    logger.synchronize_between_processes()
    return {k: m.global_avg for k, m in logger.meters.items()}


@torch.no_grad()
def evaluate(loader, model):
    model.eval()
    logger = MetricLogger()
    criterion = nn.CrossEntropyLoss()
    for images, target in loader:
        images = images.cuda(non_blocking=True)
        target = target.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            output = model(images)
            loss = criterion(output, target)
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        n = images.shape[0]
        logger.update(loss=loss.item())
        logger.update(n=n, acc1=acc1.item(), acc5=acc5.item())
    logger.synchronize_between_processes()
    return {k: m.global_avg for k, m in logger.meters.items()}


def main(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)

    train_tf = create_transform(224, is_training=True, scale=(0.08, 1.0), hflip=0.5,
                                auto_augment="rand-m9-mstd0.5-inc1", color_jitter=0.3, interpolation="bicubic")
    val_tf = transforms.Compose([
        transforms.Resize(224, interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.CenterCrop(224), transforms.ToTensor(),
        transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    ds_train = datasets.ImageFolder(os.path.join(args.data_path, "train"), train_tf)
    ds_val = datasets.ImageFolder(os.path.join(args.data_path, "val"), val_tf)
    sampler = DistributedSampler(ds_train, shuffle=True)
    loader_train = DataLoader(ds_train, sampler=sampler, batch_size=args.batch_size,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    # validation is run on a single GPU over the whole val set
    loader_val = DataLoader(ds_val, batch_size=256, shuffle=False, num_workers=args.num_workers,
                            pin_memory=True)

    model = timm.create_model(args.model, num_classes=1000, drop_path_rate=args.drop_path).cuda()
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    model_without_ddp = model.module
    ema = ModelEmaV2(model_without_ddp, decay=args.ema_decay)

    args.lr = args.lr * args.batch_size * world / 2048
    optimizer = create_optimizer_v2(model_without_ddp, opt="lamb", lr=args.lr, weight_decay=args.weight_decay)
    scheduler = CosineLRScheduler(optimizer, t_initial=args.epochs, lr_min=1e-6, warmup_t=args.warmup_epochs,
                                  warmup_lr_init=1e-6)
    scaler = NativeScaler()
    mixup_fn = Mixup(mixup_alpha=0.0, cutmix_alpha=args.cutmix, label_smoothing=args.smoothing, num_classes=1000)
    criterion = BinaryCrossEntropy(smoothing=args.smoothing)

    out = Path(args.output_dir)
    start_epoch = 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        model_without_ddp.load_state_dict(ck["model"])
        ema.module.load_state_dict(ck["model_ema"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["lr_scheduler"])
        start_epoch = ck["epoch"] + 1
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)

    max_acc = 0.0
    t0 = time.time()
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        train_stats = train_one_epoch(model, criterion, loader_train, optimizer, epoch, scaler,
                                      args.clip_grad, ema, mixup_fn, rank)
        scheduler.step(epoch + 1)

        if rank == 0:
            torch.save({"model": model_without_ddp.state_dict(), "model_ema": ema.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "lr_scheduler": scheduler.state_dict(),
                        "epoch": epoch, "args": vars(args)}, out / "checkpoint.pth")
            log = {"epoch": epoch, **{f"train_{k}": v for k, v in train_stats.items()}}
            if epoch % args.eval_every == 0 or epoch == args.epochs - 1:
                test_stats = evaluate(loader_val, ema.module)
                max_acc = max(max_acc, test_stats["acc1"])
                log.update({f"test_{k}": v for k, v in test_stats.items()})
                print(f"EMA accuracy on {len(ds_val)} images: {test_stats['acc1']:.2f}% (max {max_acc:.2f}%)")
            with open(out / "log.txt", "a") as f:
                f.write(json.dumps(log) + "\n")
        dist.barrier()

    if rank == 0:
        print("Training time", datetime.timedelta(seconds=int(time.time() - t0)))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(get_args())
