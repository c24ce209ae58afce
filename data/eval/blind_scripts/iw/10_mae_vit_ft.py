#!/usr/bin/env python3
"""End-to-end fine-tuning of an MAE-pretrained ViT-B/16 on ImageNet-1k.

Recipe from the MAE paper (Table 9): 100 epochs, blr 5e-4, layer decay 0.65,
RandAug(9, 0.5), mixup 0.8, cutmix 1.0, label smoothing 0.1, drop path 0.1, global pool.
"""
import argparse
import datetime
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets

import timm
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import CosineLRScheduler


def get_args_parser():
    parser = argparse.ArgumentParser("MAE fine-tuning", add_help=False)
    parser.add_argument("--batch_size", default=32, type=int, help="per GPU")
    parser.add_argument("--accum_iter", default=4, type=int)
    parser.add_argument("--epochs", default=100, type=int)
    parser.add_argument("--model", default="vit_base_patch16_224", type=str)
    parser.add_argument("--drop_path", default=0.1, type=float)
    parser.add_argument("--blr", default=5e-4, type=float)
    parser.add_argument("--layer_decay", default=0.65, type=float)
    parser.add_argument("--weight_decay", default=0.05, type=float)
    parser.add_argument("--min_lr", default=1e-6, type=float)
    parser.add_argument("--warmup_epochs", default=5, type=int)
    parser.add_argument("--smoothing", default=0.1, type=float)
    parser.add_argument("--mixup", default=0.8, type=float)
    parser.add_argument("--cutmix", default=1.0, type=float)
    parser.add_argument("--finetune", default="", help="MAE pre-trained checkpoint")
    parser.add_argument("--data_path", default="/datasets/imagenet", type=str)
    parser.add_argument("--output_dir", default="./output_dir")
    parser.add_argument("--log_dir", default="./output_dir")
    parser.add_argument("--seed", default=0, type=int)
    parser.add_argument("--num_workers", default=10, type=int)
    return parser


def interpolate_pos_embed(model, checkpoint_model):
    if "pos_embed" not in checkpoint_model:
        return
    pos = checkpoint_model["pos_embed"]
    embed = pos.shape[-1]
    n_extra = model.pos_embed.shape[-2] - model.patch_embed.num_patches
    orig = int((pos.shape[-2] - n_extra) ** 0.5)
    new = int(model.patch_embed.num_patches ** 0.5)
    if orig != new:
        extra, tokens = pos[:, :n_extra], pos[:, n_extra:]
        tokens = tokens.reshape(-1, orig, orig, embed).permute(0, 3, 1, 2)
        tokens = F.interpolate(tokens, size=(new, new), mode="bicubic", align_corners=False)
        tokens = tokens.permute(0, 2, 3, 1).flatten(1, 2)
        checkpoint_model["pos_embed"] = torch.cat((extra, tokens), dim=1)


@torch.no_grad()
def evaluate(data_loader, model, device):
    model.eval()
    correct, count, loss_sum = 0, 0, 0.0
    for images, target in data_loader:
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():
            output = model(images)
            loss = F.cross_entropy(output, target, reduction="sum")
        correct += (output.argmax(dim=-1) == target).sum().item()
        count += target.shape[0]
        loss_sum += loss.item()
    return {"acc1": 100.0 * correct / count, "loss": loss_sum / count}


def main(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda")

    seed = args.seed + rank
    torch.manual_seed(seed)
    np.random.seed(seed)

    t_train = create_transform(224, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                               interpolation="bicubic", re_prob=0.25, re_mode="pixel", re_count=1)
    t_val = create_transform(224, is_training=False, interpolation="bicubic", crop_pct=0.875)
    dataset_train = datasets.ImageFolder(os.path.join(args.data_path, "train"), transform=t_train)
    dataset_val = datasets.ImageFolder(os.path.join(args.data_path, "val"), transform=t_val)

    sampler_train = torch.utils.data.DistributedSampler(dataset_train, num_replicas=world_size,
                                                        rank=rank, shuffle=True)
    sampler_val = torch.utils.data.DistributedSampler(dataset_val, num_replicas=world_size,
                                                      rank=rank, shuffle=False)
    data_loader_train = torch.utils.data.DataLoader(dataset_train, sampler=sampler_train,
                                                    batch_size=args.batch_size, num_workers=args.num_workers,
                                                    pin_memory=True, drop_last=True)
    data_loader_val = torch.utils.data.DataLoader(dataset_val, sampler=sampler_val,
                                                  batch_size=args.batch_size, num_workers=args.num_workers,
                                                  pin_memory=True, drop_last=False)

    log_writer = None
    if rank == 0:
        os.makedirs(args.log_dir, exist_ok=True)
        log_writer = SummaryWriter(log_dir=args.log_dir)

    mixup_fn = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, prob=1.0, switch_prob=0.5,
                     mode="batch", label_smoothing=args.smoothing, num_classes=1000)

    model = timm.create_model(args.model, num_classes=1000, drop_path_rate=args.drop_path,
                              global_pool="avg", fc_norm=True)
    if args.finetune:
        checkpoint = torch.load(args.finetune, map_location="cpu")
        checkpoint_model = checkpoint["model"]
        for k in ["head.weight", "head.bias"]:
            checkpoint_model.pop(k, None)
        interpolate_pos_embed(model, checkpoint_model)
        msg = model.load_state_dict(checkpoint_model, strict=False)
        if rank == 0:
            print(msg)
        torch.nn.init.trunc_normal_(model.head.weight, std=2e-5)
    model.to(device)

    model = DDP(model, device_ids=[local_rank])
    model_without_ddp = model.module

    eff_batch_size = args.batch_size * args.accum_iter * world_size
    lr = args.blr * eff_batch_size / 256
    optimizer = create_optimizer_v2(model_without_ddp, opt="adamw", lr=lr, weight_decay=args.weight_decay,
                                    layer_decay=args.layer_decay)
    scaler = torch.cuda.amp.GradScaler()
    updates_per_epoch = len(data_loader_train) // args.accum_iter
    scheduler = CosineLRScheduler(optimizer, t_initial=args.epochs * updates_per_epoch, lr_min=args.min_lr,
                                  warmup_t=args.warmup_epochs * updates_per_epoch, warmup_lr_init=0.0,
                                  t_in_epochs=False)
    criterion = SoftTargetCrossEntropy()

    if rank == 0:
        print(f"lr {lr:.2e}  effective batch {eff_batch_size}")
    max_accuracy = 0.0
    start_time = time.time()
    for epoch in range(args.epochs):
        sampler_train.set_epoch(epoch)
        model.train()
        optimizer.zero_grad()
        update = epoch * updates_per_epoch
        for it, (samples, targets) in enumerate(data_loader_train):
            samples = samples.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            samples, targets = mixup_fn(samples, targets)
            with torch.cuda.amp.autocast():
                loss = criterion(model(samples), targets) / args.accum_iter
            scaler.scale(loss).backward()
            if (it + 1) % args.accum_iter == 0:
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
                update += 1
                scheduler.step_update(update)
                if log_writer is not None and update % 50 == 0:
                    log_writer.add_scalar("train/loss", loss.item() * args.accum_iter, update)
                    log_writer.add_scalar("train/lr", optimizer.param_groups[-1]["lr"], update)

        test_stats = evaluate(data_loader_val, model_without_ddp, device)
        if rank == 0:
            print(f"Accuracy of the network on the {len(dataset_val)} test images: {test_stats['acc1']:.1f}%")
            if test_stats["acc1"] > max_accuracy:
                max_accuracy = test_stats["acc1"]
                torch.save({"model": model_without_ddp.state_dict(), "epoch": epoch, "args": vars(args)},
                           os.path.join(args.output_dir, "checkpoint-best.pth"))
            torch.save({"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch},
                       os.path.join(args.output_dir, "checkpoint-last.pth"))
            print(f"Max accuracy: {max_accuracy:.2f}%")
            log_writer.add_scalar("perf/test_acc1", test_stats["acc1"], epoch)
            log_writer.add_scalar("perf/test_loss", test_stats["loss"], epoch)
            with open(os.path.join(args.output_dir, "log.txt"), "a") as f:
                f.write(json.dumps({"epoch": epoch, **{f"test_{k}": v for k, v in test_stats.items()}}) + "\n")

    if rank == 0:
        print("Training time", str(datetime.timedelta(seconds=int(time.time() - start_time))))
        log_writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    args = get_args_parser().parse_args()
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    main(args)
