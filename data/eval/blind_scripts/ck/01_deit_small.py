"""DeiT-style ViT-S/16 training on ImageNet-1k.

Repeated augmentation, mixup/cutmix, label smoothing, EMA, AMP.
Launch with torchrun, one process per GPU.
"""
import argparse
import datetime
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Sampler, Subset
from torchvision import datasets, transforms

import timm
from timm.data import Mixup, create_transform
from timm.data.constants import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import CosineLRScheduler
from timm.utils import ModelEmaV2, NativeScaler, get_state_dict


def get_args_parser():
    p = argparse.ArgumentParser("DeiT training", add_help=True)
    p.add_argument("--data-path", default="/datasets/imagenet", type=str)
    p.add_argument("--output-dir", default="./output/deit_small", type=str)
    p.add_argument("--model", default="deit_small_patch16_224", type=str)
    p.add_argument("--input-size", default=224, type=int)
    p.add_argument("--batch-size", default=128, type=int, help="per-GPU batch size")
    p.add_argument("--epochs", default=300, type=int)
    p.add_argument("--lr", default=5e-4, type=float, help="lr for a global batch of 512")
    p.add_argument("--min-lr", default=1e-5, type=float)
    p.add_argument("--warmup-lr", default=1e-6, type=float)
    p.add_argument("--warmup-epochs", default=5, type=int)
    p.add_argument("--weight-decay", default=0.05, type=float)
    p.add_argument("--clip-grad", default=None, type=float)
    p.add_argument("--drop-path", default=0.1, type=float)
    p.add_argument("--smoothing", default=0.1, type=float)
    p.add_argument("--mixup", default=0.8, type=float)
    p.add_argument("--cutmix", default=1.0, type=float)
    p.add_argument("--repeated-aug", action="store_true", default=True)
    p.add_argument("--no-repeated-aug", action="store_false", dest="repeated_aug")
    p.add_argument("--model-ema", action="store_true", default=True)
    p.add_argument("--model-ema-decay", default=0.99996, type=float)
    p.add_argument("--num-workers", default=10, type=int)
    p.add_argument("--resume", default="", type=str)
    p.add_argument("--seed", default=0, type=int)
    return p


class RASampler(Sampler):
    """Repeated augmentation sampler: each sample is shown num_repeats times per
    epoch, on different ranks, with different augmentations."""

    def __init__(self, dataset, num_replicas, rank, shuffle=True, num_repeats=3):
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self.num_repeats = num_repeats
        self.num_samples = int(math.ceil(len(dataset) * num_repeats / num_replicas))
        self.total_size = self.num_samples * self.num_replicas
        self.num_selected_samples = int(math.floor(len(dataset) // 256 * 256 / num_replicas))
        self.shuffle = shuffle

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.epoch)
        if self.shuffle:
            indices = torch.randperm(len(self.dataset), generator=g).tolist()
        else:
            indices = list(range(len(self.dataset)))
        indices = [i for i in indices for _ in range(self.num_repeats)]
        indices += indices[: self.total_size - len(indices)]
        assert len(indices) == self.total_size
        indices = indices[self.rank:self.total_size:self.num_replicas]
        assert len(indices) == self.num_samples
        return iter(indices[: self.num_selected_samples])

    def __len__(self):
        return self.num_selected_samples

    def set_epoch(self, epoch):
        self.epoch = epoch


def init_distributed_mode(args):
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        args.rank = int(os.environ["RANK"])
        args.world_size = int(os.environ["WORLD_SIZE"])
        args.gpu = int(os.environ["LOCAL_RANK"])
        args.distributed = True
    else:
        print("Not using distributed mode")
        args.rank, args.world_size, args.gpu, args.distributed = 0, 1, 0, False
        return
    torch.cuda.set_device(args.gpu)
    dist.init_process_group(backend="nccl", init_method="env://")
    dist.barrier()


def build_datasets(args):
    train_tf = create_transform(
        input_size=args.input_size, is_training=True, color_jitter=0.4,
        auto_augment="rand-m9-mstd0.5-inc1", interpolation="bicubic",
        re_prob=0.25, re_mode="pixel", re_count=1,
    )
    val_tf = transforms.Compose([
        transforms.Resize(int(args.input_size / 0.875), interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.CenterCrop(args.input_size),
        transforms.ToTensor(),
        transforms.Normalize(IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD),
    ])
    train_set = datasets.ImageFolder(os.path.join(args.data_path, "train"), transform=train_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data_path, "val"), transform=val_tf)
    return train_set, val_set


def train_one_epoch(model, criterion, loader, optimizer, device, epoch, loss_scaler,
                    clip_grad, model_ema, mixup_fn, is_main):
    model.train()
    start = time.time()
    n = len(loader)
    for it, (samples, targets) in enumerate(loader):
        samples = samples.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        samples, targets = mixup_fn(samples, targets)

        with torch.autocast("cuda", dtype=torch.float16):
            outputs = model(samples)
            loss = criterion(outputs, targets)

        optimizer.zero_grad(set_to_none=True)
        loss_scaler(loss, optimizer, clip_grad=clip_grad, parameters=model.parameters())
        torch.cuda.synchronize()
        if model_ema is not None:
            model_ema.update(model.module if hasattr(model, "module") else model)

        if is_main and it % 100 == 0:
            lr = optimizer.param_groups[0]["lr"]
            print(f"Epoch [{epoch}] [{it}/{n}] loss {loss.item():.4f} lr {lr:.3e} "
                  f"time {time.time() - start:.0f}s")


@torch.no_grad()
def evaluate(model, loader, device, distributed):
    model.eval()
    stats = torch.zeros(3, device=device)  # top1 correct, top5 correct, count
    for images, target in loader:
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            output = model(images)
        _, pred = output.topk(5, 1, True, True)
        hit = pred.eq(target.view(-1, 1))
        stats[0] += hit[:, :1].sum()
        stats[1] += hit.sum()
        stats[2] += target.numel()
    if distributed:
        dist.all_reduce(stats)
    return (stats[0] / stats[2] * 100).item(), (stats[1] / stats[2] * 100).item()


def main(args):
    init_distributed_mode(args)
    device = torch.device("cuda", args.gpu)
    is_main = args.rank == 0
    torch.manual_seed(args.seed + args.rank)
    torch.backends.cudnn.benchmark = True

    train_set, val_set = build_datasets(args)
    if args.distributed and args.repeated_aug:
        sampler_train = RASampler(train_set, num_replicas=args.world_size, rank=args.rank)
    elif args.distributed:
        sampler_train = torch.utils.data.DistributedSampler(train_set, shuffle=True)
    else:
        sampler_train = torch.utils.data.RandomSampler(train_set)
    # each rank evaluates a disjoint slice; no padding, so counts add up exactly
    val_shard = Subset(val_set, list(range(args.rank, len(val_set), args.world_size)))

    loader_train = DataLoader(train_set, sampler=sampler_train, batch_size=args.batch_size,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    loader_val = DataLoader(val_shard, batch_size=int(1.5 * args.batch_size), shuffle=False,
                            num_workers=args.num_workers, pin_memory=True)

    mixup_fn = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=args.smoothing,
                     num_classes=1000)

    model = timm.create_model(args.model, pretrained=False, num_classes=1000, drop_path_rate=args.drop_path)
    model.to(device)

    model_without_ddp = model
    if args.distributed:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
        model_without_ddp = model.module
    # EMA copy is taken after DDP has broadcast rank 0's initial weights
    model_ema = ModelEmaV2(model_without_ddp, decay=args.model_ema_decay) if args.model_ema else None
    n_params = sum(p.numel() for p in model_without_ddp.parameters() if p.requires_grad)
    if is_main:
        print(f"number of params: {n_params / 1e6:.1f}M")

    global_batch = args.batch_size * args.world_size
    args.lr = args.lr * global_batch / 512.0
    optimizer = create_optimizer_v2(model_without_ddp, opt="adamw", lr=args.lr, weight_decay=args.weight_decay)
    loss_scaler = NativeScaler()
    lr_scheduler = CosineLRScheduler(optimizer, t_initial=args.epochs, lr_min=args.min_lr,
                                     warmup_t=args.warmup_epochs, warmup_lr_init=args.warmup_lr)
    criterion = SoftTargetCrossEntropy()

    start_epoch = 0
    output_dir = Path(args.output_dir)
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model_without_ddp.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        lr_scheduler.load_state_dict(ckpt["lr_scheduler"])
        loss_scaler.load_state_dict(ckpt["scaler"])
        if model_ema is not None and "model_ema" in ckpt:
            model_ema.module.load_state_dict(ckpt["model_ema"])
        start_epoch = ckpt["epoch"] + 1

    if is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        print(f"Start training for {args.epochs} epochs, global batch {global_batch}, lr {args.lr:.2e}")
    max_acc = 0.0
    t0 = time.time()
    for epoch in range(start_epoch, args.epochs):
        train_one_epoch(model, criterion, loader_train, optimizer, device, epoch, loss_scaler,
                        args.clip_grad, model_ema, mixup_fn, is_main)
        lr_scheduler.step(epoch + 1)

        acc1, acc5 = evaluate(model_without_ddp, loader_val, device, args.distributed)
        ema_acc1 = None
        if model_ema is not None:
            ema_acc1, _ = evaluate(model_ema.module, loader_val, device, args.distributed)
        max_acc = max(max_acc, acc1)

        if is_main:
            state = {
                "model": model_without_ddp.state_dict(),
                "optimizer": optimizer.state_dict(),
                "lr_scheduler": lr_scheduler.state_dict(),
                "scaler": loss_scaler.state_dict(),
                "epoch": epoch,
                "args": vars(args),
            }
            if model_ema is not None:
                state["model_ema"] = get_state_dict(model_ema)
            torch.save(state, output_dir / "checkpoint.pth")
            log = {"epoch": epoch, "acc1": acc1, "acc5": acc5, "ema_acc1": ema_acc1, "max_acc1": max_acc}
            with open(output_dir / "log.txt", "a") as f:
                f.write(json.dumps(log) + "\n")
            print(f"Epoch {epoch}: acc1 {acc1:.2f} acc5 {acc5:.2f} (max {max_acc:.2f})")

    if is_main:
        print("Training time", str(datetime.timedelta(seconds=int(time.time() - t0))))
    if args.distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    args = get_args_parser().parse_args()
    main(args)
