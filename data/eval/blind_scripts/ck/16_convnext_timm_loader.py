#!/usr/bin/env python3
"""ConvNeXt-S ImageNet training using timm's data pipeline (prefetcher + fast mixup collate).

    torchrun --nproc_per_node=8 16_convnext_timm_loader.py --data-dir /data/imagenet
"""
import argparse
import logging
import math
import os
import time
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as NativeDDP
from torch.utils.data import DataLoader, Subset

import timm
from timm.data import FastCollateMixup, create_dataset, create_loader, resolve_data_config, create_transform
from timm.loss import SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.utils import AverageMeter, CheckpointSaver, ModelEmaV2, NativeScaler, setup_default_logging

_logger = logging.getLogger("train")


def parse_args():
    parser = argparse.ArgumentParser(description="ConvNeXt-S training")
    parser.add_argument("--data-dir", default="/data/imagenet")
    parser.add_argument("--output", default="./output/convnext_small")
    parser.add_argument("--model", default="convnext_small")
    parser.add_argument("-b", "--batch-size", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--warmup-epochs", type=int, default=20)
    parser.add_argument("--lr", type=float, default=4e-3, help="for global batch 4096")
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--drop-path", type=float, default=0.4)
    parser.add_argument("--clip-grad", type=float, default=None)
    parser.add_argument("--aa", default="rand-m9-mstd0.5-inc1")
    parser.add_argument("--reprob", type=float, default=0.25)
    parser.add_argument("--mixup", type=float, default=0.8)
    parser.add_argument("--cutmix", type=float, default=1.0)
    parser.add_argument("--smoothing", type=float, default=0.1)
    parser.add_argument("--model-ema-decay", type=float, default=0.9999)
    parser.add_argument("--workers", type=int, default=10)
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def train_one_epoch(epoch, model, loader, optimizer, loss_fn, args, lr_scheduler, loss_scaler, model_ema, rank):
    losses = AverageMeter()
    model.train()
    num_batches = len(loader)
    num_updates = epoch * num_batches
    end = time.time()
    for it, (input, target) in enumerate(loader):
        # prefetcher already moved the batch to the GPU, normalised it and applied mixup
        input = input.contiguous(memory_format=torch.channels_last)
        with torch.autocast("cuda", dtype=torch.float16):
            output = model(input)
            loss = loss_fn(output, target)
        loss_value = loss.item()
        if not math.isfinite(loss_value):
            _logger.warning(f"rank {rank}: non-finite loss {loss_value} at epoch {epoch} it {it}, skipping batch")
            optimizer.zero_grad(set_to_none=True)
            continue
        optimizer.zero_grad(set_to_none=True)
        loss_scaler(loss, optimizer, clip_grad=args.clip_grad, parameters=model.parameters())
        model_ema.update(model.module)
        losses.update(loss_value, input.size(0))
        num_updates += 1
        lr_scheduler.step_update(num_updates=num_updates)
        if rank == 0 and it % 100 == 0:
            lr = optimizer.param_groups[0]["lr"]
            _logger.info(f"Train: {epoch} [{it}/{num_batches}] loss {losses.val:.4f} ({losses.avg:.4f}) "
                         f"lr {lr:.3e} {input.size(0) * dist.get_world_size() / (time.time() - end):.0f} img/s")
        end = time.time()
    return OrderedDict([("loss", losses.avg)])


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    m = torch.zeros(3, device=device)
    for input, target in loader:
        input = input.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
        target = target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            output = model(input)
        top5 = output.topk(5, 1).indices
        m[0] += (top5[:, 0] == target).sum()
        m[1] += (top5 == target[:, None]).sum()
        m[2] += target.numel()
    dist.all_reduce(m)
    return OrderedDict([("top1", (100 * m[0] / m[2]).item()), ("top5", (100 * m[1] / m[2]).item())])


def main():
    setup_default_logging()
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    if rank != 0:
        _logger.setLevel(logging.WARNING)
    torch.manual_seed(args.seed)

    model = timm.create_model(args.model, num_classes=1000, drop_path_rate=args.drop_path)
    data_config = resolve_data_config(vars(args), model=model)
    model.to(device, memory_format=torch.channels_last)
    model_ema = ModelEmaV2(model, decay=args.model_ema_decay)
    torch.manual_seed(args.seed + rank)  # model init above is identical across ranks

    lr = args.lr * args.batch_size * world_size / 4096
    optimizer = create_optimizer_v2(model, opt="adamw", lr=lr, weight_decay=args.weight_decay)
    loss_scaler = NativeScaler()
    model = NativeDDP(model, device_ids=[local_rank])

    dataset_train = create_dataset("", root=args.data_dir, split="train", is_training=True)
    dataset_eval = create_dataset("", root=args.data_dir, split="validation", is_training=False)
    collate_fn = FastCollateMixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix,
                                  label_smoothing=args.smoothing, num_classes=1000)
    loader_train = create_loader(
        dataset_train, input_size=data_config["input_size"], batch_size=args.batch_size, is_training=True,
        use_prefetcher=True, re_prob=args.reprob, re_mode="pixel", re_count=1, auto_augment=args.aa,
        interpolation="random", mean=data_config["mean"], std=data_config["std"], num_workers=args.workers,
        distributed=True, collate_fn=collate_fn, pin_memory=True, device=device,
    )
    dataset_eval.transform = create_transform(data_config["input_size"], is_training=False,
                                              interpolation=data_config["interpolation"],
                                              crop_pct=data_config["crop_pct"])
    loader_eval = DataLoader(Subset(dataset_eval, range(rank, len(dataset_eval), world_size)),
                             batch_size=2 * args.batch_size, num_workers=args.workers, pin_memory=True)

    updates_per_epoch = len(loader_train)
    lr_scheduler, num_epochs = create_scheduler_v2(optimizer, sched="cosine", num_epochs=args.epochs,
                                                   warmup_epochs=args.warmup_epochs, warmup_lr=1e-6, min_lr=1e-6,
                                                   step_on_epochs=False, updates_per_epoch=updates_per_epoch)
    train_loss_fn = SoftTargetCrossEntropy().to(device)

    saver = None
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        saver = CheckpointSaver(model=model, optimizer=optimizer, args=args, model_ema=model_ema,
                                amp_scaler=loss_scaler, checkpoint_dir=args.output, recovery_dir=args.output,
                                decreasing=False, max_history=3)
    _logger.info(f"global batch {args.batch_size * world_size}, lr {lr:.2e}, {updates_per_epoch} updates/epoch")

    for epoch in range(num_epochs):
        if hasattr(loader_train.sampler, "set_epoch"):
            loader_train.sampler.set_epoch(epoch)
        train_metrics = train_one_epoch(epoch, model, loader_train, optimizer, train_loss_fn, args,
                                        lr_scheduler, loss_scaler, model_ema, rank)
        eval_metrics = validate(model.module, loader_eval, device)
        ema_metrics = validate(model_ema.module, loader_eval, device)
        _logger.info(f"epoch {epoch}: train loss {train_metrics['loss']:.4f} top1 {eval_metrics['top1']:.2f} "
                     f"ema top1 {ema_metrics['top1']:.2f}")
        if lr_scheduler is not None:
            lr_scheduler.step(epoch + 1)
        if saver is not None:
            best_metric, best_epoch = saver.save_checkpoint(epoch, metric=ema_metrics["top1"])

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
