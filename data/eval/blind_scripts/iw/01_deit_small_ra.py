#!/usr/bin/env python3
"""DeiT-S/16 on ImageNet-1k: repeated augmentation, mixup/cutmix, EMA.

One process per GPU (torchrun). Recipe follows the DeiT paper, 300 epochs.
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
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torchvision import datasets

import timm
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import CosineLRScheduler
from timm.utils import ModelEmaV2, NativeScaler, accuracy


def get_args():
    p = argparse.ArgumentParser("DeiT-S training")
    p.add_argument("--data-path", default="/datasets/imagenet", type=str)
    p.add_argument("--model", default="deit_small_patch16_224", type=str)
    p.add_argument("--input-size", default=224, type=int)
    p.add_argument("--batch-size", default=128, type=int, help="per GPU")
    p.add_argument("--epochs", default=300, type=int)
    p.add_argument("--lr", default=5e-4, type=float, help="lr for a global batch of 512")
    p.add_argument("--min-lr", default=1e-5, type=float)
    p.add_argument("--warmup-epochs", default=5, type=int)
    p.add_argument("--weight-decay", default=0.05, type=float)
    p.add_argument("--clip-grad", default=None, type=float)
    p.add_argument("--drop-path", default=0.1, type=float)
    p.add_argument("--smoothing", default=0.1, type=float)
    p.add_argument("--mixup", default=0.8, type=float)
    p.add_argument("--cutmix", default=1.0, type=float)
    p.add_argument("--mixup-prob", default=1.0, type=float)
    p.add_argument("--mixup-switch-prob", default=0.5, type=float)
    p.add_argument("--aa", default="rand-m9-mstd0.5-inc1", type=str)
    p.add_argument("--reprob", default=0.25, type=float)
    p.add_argument("--num-repeats", default=3, type=int)
    p.add_argument("--model-ema-decay", default=0.99996, type=float)
    p.add_argument("--workers", default=10, type=int)
    p.add_argument("--output-dir", default="./output/deit_s", type=str)
    p.add_argument("--resume", default="", type=str)
    p.add_argument("--seed", default=0, type=int)
    return p.parse_args()


class RASampler(torch.utils.data.Sampler):
    """Repeated augmentation sampler (Hoffer et al. / DeiT).

    Every image is repeated `num_repeats` times per epoch and the repeats land on
    different GPUs, so each rank sees a different augmentation of the same image.
    """

    def __init__(self, dataset, num_replicas, rank, shuffle=True, num_repeats=3):
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self.num_repeats = num_repeats
        self.num_samples = int(math.ceil(len(dataset) * num_repeats / num_replicas))
        self.total_size = self.num_samples * num_replicas
        self.num_selected_samples = int(math.floor(len(dataset) // 256 * 256 / num_replicas))
        self.shuffle = shuffle

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.epoch)
        if self.shuffle:
            indices = torch.randperm(len(self.dataset), generator=g)
        else:
            indices = torch.arange(len(self.dataset))
        indices = torch.repeat_interleave(indices, repeats=self.num_repeats, dim=0).tolist()
        padding = self.total_size - len(indices)
        if padding > 0:
            indices += indices[:padding]
        assert len(indices) == self.total_size
        indices = indices[self.rank:self.total_size:self.num_replicas]
        assert len(indices) == self.num_samples
        return iter(indices[: self.num_selected_samples])

    def __len__(self):
        return self.num_selected_samples

    def set_epoch(self, epoch):
        self.epoch = epoch


def setup_distributed():
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    dist.barrier()
    return rank, world_size, local_rank


def train_one_epoch(model, criterion, loader, optimizer, scheduler, loss_scaler, mixup_fn,
                    model_ema, device, epoch, args, num_updates):
    model.train()
    t0 = time.time()
    running = torch.zeros(2, device=device)
    for it, (samples, targets) in enumerate(loader):
        samples = samples.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        samples, targets = mixup_fn(samples, targets)

        with torch.cuda.amp.autocast():
            outputs = model(samples)
            loss = criterion(outputs, targets)

        optimizer.zero_grad(set_to_none=True)
        loss_scaler(loss, optimizer, clip_grad=args.clip_grad, parameters=model.parameters())
        torch.cuda.synchronize()
        model_ema.update(model.module)
        num_updates += 1
        scheduler.step_update(num_updates=num_updates)

        running[0] += loss.detach()
        running[1] += 1
        if it % 100 == 0 and dist.get_rank() == 0:
            lr = optimizer.param_groups[0]["lr"]
            print(f"epoch {epoch} it {it}/{len(loader)} loss {loss.item():.4f} lr {lr:.3e} "
                  f"({time.time() - t0:.0f}s)", flush=True)

    dist.all_reduce(running)
    return {"train_loss": (running[0] / running[1]).item()}, num_updates


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(4, device=device, dtype=torch.float64)
    for images, target in loader:
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():
            output = model(images)
        loss = F.cross_entropy(output.float(), target, reduction="sum")
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        n = target.size(0)
        stats[0] += loss.double()
        stats[1] += acc1.double() * n / 100.0
        stats[2] += acc5.double() * n / 100.0
        stats[3] += n
    dist.all_reduce(stats)
    return {"loss": (stats[0] / stats[3]).item(),
            "acc1": (100.0 * stats[1] / stats[3]).item(),
            "acc5": (100.0 * stats[2] / stats[3]).item()}


def main():
    args = get_args()
    rank, world_size, local_rank = setup_distributed()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    torch.manual_seed(args.seed + rank)
    torch.backends.cudnn.benchmark = True

    train_tf = create_transform(args.input_size, is_training=True, auto_augment=args.aa,
                                interpolation="bicubic", re_prob=args.reprob,
                                re_mode="pixel", re_count=1)
    val_tf = create_transform(args.input_size, is_training=False, interpolation="bicubic",
                              crop_pct=0.875)
    dataset_train = datasets.ImageFolder(os.path.join(args.data_path, "train"), transform=train_tf)
    dataset_val = datasets.ImageFolder(os.path.join(args.data_path, "val"), transform=val_tf)
    num_classes = len(dataset_train.classes)

    sampler_train = RASampler(dataset_train, num_replicas=world_size, rank=rank,
                              shuffle=True, num_repeats=args.num_repeats)
    # every rank evaluates a disjoint strided slice of val, no padding
    val_shard = torch.utils.data.Subset(dataset_val, range(rank, len(dataset_val), world_size))

    loader_train = torch.utils.data.DataLoader(
        dataset_train, sampler=sampler_train, batch_size=args.batch_size,
        num_workers=args.workers, pin_memory=True, drop_last=True, persistent_workers=True)
    loader_val = torch.utils.data.DataLoader(
        val_shard, batch_size=int(1.5 * args.batch_size), shuffle=False,
        num_workers=args.workers, pin_memory=True, drop_last=False)

    mixup_fn = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, prob=args.mixup_prob,
                     switch_prob=args.mixup_switch_prob, mode="batch",
                     label_smoothing=args.smoothing, num_classes=num_classes)

    model = timm.create_model(args.model, pretrained=False, num_classes=num_classes,
                              drop_path_rate=args.drop_path)
    model.to(device)

    model = DDP(model, device_ids=[local_rank])
    model_without_ddp = model.module
    model_ema = ModelEmaV2(model_without_ddp, decay=args.model_ema_decay)
    if is_main:
        n_params = sum(p.numel() for p in model_without_ddp.parameters())
        print(f"{args.model}: {n_params / 1e6:.1f}M params, {world_size} GPUs", flush=True)

    # linear scaling rule on the global batch
    global_batch = args.batch_size * world_size
    lr = args.lr * global_batch / 512.0
    optimizer = create_optimizer_v2(model_without_ddp, opt="adamw", lr=lr,
                                    weight_decay=args.weight_decay)
    loss_scaler = NativeScaler()
    updates_per_epoch = len(loader_train)
    scheduler = CosineLRScheduler(optimizer, t_initial=args.epochs * updates_per_epoch,
                                  lr_min=args.min_lr, warmup_t=args.warmup_epochs * updates_per_epoch,
                                  warmup_lr_init=1e-6, t_in_epochs=False)
    criterion = SoftTargetCrossEntropy()

    output_dir = Path(args.output_dir)
    if is_main:
        output_dir.mkdir(parents=True, exist_ok=True)

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model_without_ddp.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        loss_scaler.load_state_dict(ckpt["scaler"])
        model_ema.module.load_state_dict(ckpt["model_ema"])
        start_epoch = ckpt["epoch"] + 1
        if is_main:
            print(f"resumed from {args.resume} at epoch {start_epoch}")
    num_updates = start_epoch * updates_per_epoch

    best_acc = 0.0
    start_time = time.time()
    for epoch in range(start_epoch, args.epochs):
        train_stats, num_updates = train_one_epoch(
            model, criterion, loader_train, optimizer, scheduler, loss_scaler, mixup_fn,
            model_ema, device, epoch, args, num_updates)

        val_stats = evaluate(model_without_ddp, loader_val, device)
        ema_stats = evaluate(model_ema.module, loader_val, device)
        best_acc = max(best_acc, val_stats["acc1"], ema_stats["acc1"])

        if is_main:
            ckpt = {"model": model_without_ddp.state_dict(),
                    "model_ema": model_ema.module.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scaler": loss_scaler.state_dict(),
                    "epoch": epoch, "args": vars(args)}
            torch.save(ckpt, output_dir / "checkpoint.pth")
            log = {"epoch": epoch, **train_stats,
                   **{f"val_{k}": v for k, v in val_stats.items()},
                   **{f"ema_{k}": v for k, v in ema_stats.items()},
                   "best_acc1": best_acc}
            with open(output_dir / "log.txt", "a") as f:
                f.write(json.dumps(log) + "\n")
            print(f"epoch {epoch}: top-1 {val_stats['acc1']:.2f} ema {ema_stats['acc1']:.2f} "
                  f"best {best_acc:.2f}", flush=True)

    if is_main:
        total = str(datetime.timedelta(seconds=int(time.time() - start_time)))
        print(f"training time {total}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
