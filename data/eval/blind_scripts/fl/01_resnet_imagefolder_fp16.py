#!/usr/bin/env python
"""ResNet-50 training on an ImageFolder dataset with DeepSpeed ZeRO-2 + fp16.

Launch:
    deepspeed --num_gpus 8 01_resnet_imagefolder_fp16.py --data /datasets/inat-mini --epochs 30
"""
import argparse
import json
import logging
import os
import time

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

logger = logging.getLogger("resnet_ds")


def parse_args():
    p = argparse.ArgumentParser(description="ResNet-50 DeepSpeed training")
    p.add_argument("--data", type=str, required=True)
    p.add_argument("--arch", type=str, default="resnet50")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--micro-batch", type=int, default=64)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--warmup-epochs", type=int, default=2)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--output-dir", type=str, default="./runs/resnet50")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--local_rank", type=int, default=-1)
    p = deepspeed.add_config_arguments(p)
    return p.parse_args()


def build_transforms():
    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        normalize,
    ])
    val_tf = transforms.Compose([
        transforms.Resize(256),
        transforms.CenterCrop(224),
        transforms.ToTensor(),
        normalize,
    ])
    return train_tf, val_tf


def build_ds_config(args, world_size, steps_per_epoch):
    total_steps = steps_per_epoch * args.epochs
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "train_batch_size": args.micro_batch * args.grad_accum * world_size,
        "steps_per_print": 200,
        "optimizer": {
            "type": "SGD",
            "params": {"lr": args.lr, "momentum": 0.9, "weight_decay": args.weight_decay},
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": args.lr,
                "warmup_num_steps": steps_per_epoch * args.warmup_epochs,
                "total_num_steps": total_steps,
            },
        },
        "fp16": {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": 16,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": 1,
        },
        "zero_optimization": {
            "stage": 2,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 5e8,
            "allgather_bucket_size": 5e8,
        },
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
        "wall_clock_breakdown": False,
    }


@torch.no_grad()
def evaluate(engine, loader, criterion):
    engine.eval()
    stats = torch.zeros(3, device=engine.device)  # loss_sum, correct, count
    for images, targets in loader:
        images = images.to(engine.local_rank, non_blocking=True)
        targets = targets.to(engine.local_rank, non_blocking=True)
        logits = engine(images)
        loss = criterion(logits.float(), targets)
        stats[0] += loss.item() * targets.size(0)
        stats[1] += (logits.argmax(dim=1) == targets).sum()
        stats[2] += targets.size(0)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    engine.train()
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    deepspeed.init_distributed(dist_backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    torch.cuda.set_device(local_rank)
    torch.backends.cudnn.benchmark = True

    train_tf, val_tf = build_transforms()
    train_set = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = torchvision.datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)

    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.micro_batch, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=args.micro_batch, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    model = torchvision.models.__dict__[args.arch](num_classes=len(train_set.classes))
    steps_per_epoch = len(train_loader) // args.grad_accum
    ds_config = build_ds_config(args, world_size, steps_per_epoch)

    engine, _, _, lr_scheduler = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=ds_config,
    )
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    start_epoch = 0
    best_acc = 0.0
    if args.resume:
        load_path, client_state = engine.load_checkpoint(args.output_dir)
        if load_path is not None:
            start_epoch = client_state["epoch"] + 1
            best_acc = client_state.get("best_acc", 0.0)
            if rank == 0:
                logger.info("resumed from %s at epoch %d", load_path, start_epoch)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "ds_config.json"), "w") as f:
            json.dump(ds_config, f, indent=2)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        engine.train()
        t0 = time.time()
        running = 0.0
        for step, (images, targets) in enumerate(train_loader):
            images = images.to(engine.local_rank, non_blocking=True)
            targets = targets.to(engine.local_rank, non_blocking=True)

            logits = engine(images)
            loss = criterion(logits.float(), targets)
            engine.backward(loss)
            engine.step()

            running += loss.item()
            if rank == 0 and step % 100 == 0:
                logger.info("epoch %d step %d/%d loss %.4f lr %.5f scale %.0f",
                            epoch, step, len(train_loader), running / (step + 1),
                            lr_scheduler.get_last_lr()[0], engine.optimizer.cur_scale)

        val_loss, val_acc = evaluate(engine, val_loader, criterion)
        if rank == 0:
            logger.info("epoch %d done in %.1fs  val_loss %.4f  val_acc %.4f",
                        epoch, time.time() - t0, val_loss, val_acc)

        is_best = val_acc > best_acc
        best_acc = max(best_acc, val_acc)
        engine.save_checkpoint(args.output_dir, tag=f"epoch{epoch}",
                               client_state={"epoch": epoch, "best_acc": best_acc})
        if is_best and rank == 0:
            # ZeRO-2 keeps full fp16 weights on every rank, export an fp32 copy for serving
            state = {k: v.float().cpu() for k, v in engine.module.state_dict().items()}
            torch.save({"model": state, "classes": train_set.classes, "epoch": epoch},
                       os.path.join(args.output_dir, "best_model.pt"))

    dist.barrier()
    if rank == 0:
        logger.info("training finished, best val acc %.4f", best_acc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
