#!/usr/bin/env python
"""'ResNet strikes back' A2-style recipe on the benchmark cluster.

LAMB + BCE, mixup/cutmix via timm, fp16 AMP, channels_last, EMA.
    torchrun --standalone --nproc_per_node=8 04_timm_lamb_a1_recipe.py \
        --data-dir /mnt/imagenet --model resnet50 --epochs 300
"""
import argparse
import os
import time
from contextlib import suppress

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as NativeDDP

import timm
from timm.data import Mixup, create_dataset, create_loader, resolve_data_config
from timm.loss import BinaryCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.utils import ModelEmaV2, NativeScaler, AverageMeter


def get_args():
    parser = argparse.ArgumentParser("rsb-a2")
    parser.add_argument("--data-dir", default="/mnt/imagenet")
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=256, help="per-GPU batch")
    parser.add_argument("--lr-base", type=float, default=5e-3, help="lr at global batch 2048")
    parser.add_argument("--weight-decay", type=float, default=0.02)
    parser.add_argument("--warmup-epochs", type=int, default=5)
    parser.add_argument("--mixup", type=float, default=0.1)
    parser.add_argument("--cutmix", type=float, default=1.0)
    parser.add_argument("--smoothing", type=float, default=0.0)
    parser.add_argument("--drop-path", type=float, default=0.05)
    parser.add_argument("--model-ema-decay", type=float, default=0.9998)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--train-crop", type=int, default=224)
    parser.add_argument("--output", default="/mnt/results/rsb_a2")
    parser.add_argument("--log-interval", type=int, default=50)
    return parser.parse_args()


def init_distributed():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    return dist.get_rank(), dist.get_world_size(), local_rank


def validate(model, loader, device):
    model.eval()
    correct = 0
    total = 0
    with torch.no_grad():
        for images, target in loader:
            with torch.autocast("cuda", dtype=torch.float16):
                output = model(images)
            correct += (output.argmax(dim=1) == target).sum().item()
            total += target.size(0)
    counts = torch.tensor([correct, total], dtype=torch.float64)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    return 100.0 * counts[0].item() / counts[1].item()


def main():
    args = get_args()
    rank, world_size, local_rank = init_distributed()
    device = torch.device("cuda", local_rank)
    timm.utils.random_seed(42, rank)

    model = timm.create_model(args.model, pretrained=False, num_classes=1000,
                              drop_path_rate=args.drop_path)
    model.to(device=device, memory_format=torch.channels_last)
    data_config = resolve_data_config({"input_size": (3, args.train_crop, args.train_crop)},
                                      model=model)

    global_batch = args.batch_size * world_size
    lr = args.lr_base * global_batch / 2048
    optimizer = create_optimizer_v2(model, opt="lamb", lr=lr, weight_decay=args.weight_decay)
    loss_scaler = NativeScaler()
    amp_autocast = lambda: torch.autocast("cuda", dtype=torch.float16)  # noqa: E731

    model = NativeDDP(model, device_ids=[local_rank])
    model_ema = ModelEmaV2(model.module, decay=args.model_ema_decay)

    dataset_train = create_dataset("", root=args.data_dir, split="train", is_training=True)
    dataset_eval = create_dataset("", root=args.data_dir, split="validation", is_training=False)
    mixup_fn = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix,
                     label_smoothing=args.smoothing, num_classes=1000)

    loader_train = create_loader(dataset_train, input_size=data_config["input_size"],
                                 batch_size=args.batch_size, is_training=True,
                                 use_prefetcher=True, re_prob=0.0, auto_augment="rand-m7-mstd0.5-inc1",
                                 interpolation="random", mean=data_config["mean"],
                                 std=data_config["std"], num_workers=args.workers,
                                 distributed=True, pin_memory=True, device=device)
    loader_eval = create_loader(dataset_eval, input_size=data_config["input_size"],
                                batch_size=args.batch_size, is_training=False,
                                use_prefetcher=True, interpolation=data_config["interpolation"],
                                mean=data_config["mean"], std=data_config["std"],
                                num_workers=args.workers, distributed=True,
                                crop_pct=0.95, pin_memory=True, device=device)

    updates_per_epoch = len(loader_train)
    lr_scheduler, num_epochs = create_scheduler_v2(optimizer, sched="cosine",
                                                   num_epochs=args.epochs,
                                                   warmup_epochs=args.warmup_epochs,
                                                   warmup_lr=1e-6, min_lr=1e-6,
                                                   updates_per_epoch=updates_per_epoch)
    train_loss_fn = BinaryCrossEntropy(target_threshold=0.2).to(device)

    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        print(f"{args.model}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
              f"global batch {global_batch}, lr {lr:.2e}, {updates_per_epoch} updates/epoch",
              flush=True)

    best_top1 = 0.0
    for epoch in range(num_epochs):
        if hasattr(loader_train.sampler, "set_epoch"):
            loader_train.sampler.set_epoch(epoch)
        model.train()
        loss_m = AverageMeter()
        tick = time.time()
        num_updates = epoch * updates_per_epoch
        for batch_idx, (inputs, target) in enumerate(loader_train):
            inputs, target = mixup_fn(inputs, target)
            inputs = inputs.contiguous(memory_format=torch.channels_last)
            with amp_autocast():
                output = model(inputs)
                loss = train_loss_fn(output, target)
            optimizer.zero_grad(set_to_none=True)
            loss_scaler(loss, optimizer, parameters=model.parameters())
            model_ema.update(model.module)
            num_updates += 1
            lr_scheduler.step_update(num_updates=num_updates)
            loss_m.update(loss.item(), inputs.size(0))

            if rank == 0 and batch_idx % args.log_interval == 0:
                torch.cuda.synchronize()
                rate = args.log_interval * global_batch / (time.time() - tick)
                tick = time.time()
                print(f"Train: {epoch} [{batch_idx:>4d}/{updates_per_epoch}] "
                      f"loss {loss_m.val:.4f} ({loss_m.avg:.4f}) "
                      f"lr {optimizer.param_groups[0]['lr']:.3e} {rate:.0f} img/s", flush=True)

        lr_scheduler.step(epoch + 1)
        top1 = validate(model, loader_eval, device)
        ema_top1 = validate(model_ema.module, loader_eval, device)

        if rank == 0:
            print(f"Epoch {epoch}: top1 {top1:.3f} ema top1 {ema_top1:.3f}", flush=True)
            state = {"epoch": epoch, "arch": args.model,
                     "state_dict": model.module.state_dict(),
                     "state_dict_ema": model_ema.module.state_dict(),
                     "optimizer": optimizer.state_dict(),
                     "scaler": loss_scaler.state_dict()}
            torch.save(state, os.path.join(args.output, "last.pth.tar"))
            if ema_top1 > best_top1:
                best_top1 = ema_top1
                torch.save(state, os.path.join(args.output, "model_best.pth.tar"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
