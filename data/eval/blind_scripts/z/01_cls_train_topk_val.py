# -*- coding: utf-8 -*-
"""
ConvNeXt 图像分类多卡训练脚本，每隔 eval_freq 个 epoch 在验证集上统计 top-1 / top-5。

启动：
    python -m torch.distributed.launch --nproc_per_node=8 --use-env \
        01_cls_train_topk_val.py --data /data/imagenet100 --output ./output/convnext_t
"""
import argparse
import json
import logging
import math
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Sampler
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

logger = logging.getLogger("train")


def parse_args():
    p = argparse.ArgumentParser(description="ConvNeXt 多卡训练 + 验证")
    p.add_argument("--data", type=str, required=True, help="ImageFolder 格式，包含 train/ 和 val/")
    p.add_argument("--model", type=str, default="convnext_tiny")
    p.add_argument("--num-classes", type=int, default=100)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=128, help="单卡 batch size")
    p.add_argument("--base-lr", type=float, default=4e-3, help="全局 batch 4096 时的学习率，按线性规则缩放")
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--output", type=str, default="./output/convnext")
    p.add_argument("--resume", type=str, default="")
    p.add_argument("--eval-freq", type=int, default=1)
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1)
    return p.parse_args()


class ShardSampler(Sampler):
    """验证集按 rank 切分，不补齐样本，保证统计量精确。"""

    def __init__(self, num_samples, rank, world_size):
        self.indices = list(range(rank, num_samples, world_size))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


def setup_logging(rank, output):
    fmt = "[%(asctime)s][rank{}] %(message)s".format(rank)
    handlers = [logging.StreamHandler()]
    if rank == 0:
        os.makedirs(output, exist_ok=True)
        handlers.append(logging.FileHandler(os.path.join(output, "train.log")))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN, format=fmt, handlers=handlers)


def build_loaders(args, rank, world_size):
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224),
        transforms.RandomHorizontalFlip(),
        transforms.ColorJitter(0.3, 0.3, 0.3),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    val_tf = transforms.Compose([
        transforms.Resize(256),
        transforms.CenterCrop(224),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)

    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    val_sampler = ShardSampler(len(val_set), rank, world_size)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)
    return train_loader, val_loader, train_sampler


def lr_at(step, total_steps, warmup_steps, peak_lr):
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return peak_lr * 0.5 * (1.0 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct1, correct5, total, loss_sum = 0, 0, 0, 0.0
    for images, targets in loader:
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(images)
        logits = logits.float()
        loss_sum += F.cross_entropy(logits, targets, reduction="sum").item()
        top5 = logits.topk(5, dim=1).indices
        correct1 += (top5[:, 0] == targets).sum().item()
        correct5 += (top5 == targets[:, None]).any(dim=1).sum().item()
        total += targets.size(0)

    # 汇总所有卡的统计量
    stats = torch.tensor([correct1, correct5, total, loss_sum], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    correct1, correct5, total, loss_sum = stats.tolist()
    return {
        "top1": 100.0 * correct1 / total,
        "top5": 100.0 * correct5 / total,
        "loss": loss_sum / total,
    }


def save_checkpoint(path, model, optimizer, epoch, step, best_top1):
    torch.save({
        "model": model.module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": epoch,
        "step": step,
        "best_top1": best_top1,
    }, path)


def main():
    args = parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    setup_logging(rank, args.output)

    torch.manual_seed(42 + rank)
    torch.backends.cudnn.benchmark = True

    train_loader, val_loader, train_sampler = build_loaders(args, rank, world_size)

    model = timm.create_model(args.model, pretrained=True, num_classes=args.num_classes,
                              drop_path_rate=0.1)
    model.to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    global_batch = args.batch_size * world_size
    peak_lr = args.base_lr * global_batch / 4096
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak_lr, weight_decay=args.weight_decay)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)

    steps_per_epoch = len(train_loader)
    total_steps = steps_per_epoch * args.epochs
    warmup_steps = steps_per_epoch * args.warmup_epochs

    start_epoch, step, best_top1 = 0, 0, 0.0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch, step, best_top1 = ckpt["epoch"] + 1, ckpt["step"], ckpt["best_top1"]
        logger.info("从 %s 恢复训练，epoch=%d, best_top1=%.2f", args.resume, start_epoch, best_top1)

    logger.info("world_size=%d, 全局 batch=%d, peak lr=%.2e, 每个 epoch %d 步",
                world_size, global_batch, peak_lr, steps_per_epoch)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (images, targets) in enumerate(train_loader):
            images = images.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            lr = lr_at(step, total_steps, warmup_steps, peak_lr)
            for g in optimizer.param_groups:
                g["lr"] = lr

            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(images)
                loss = criterion(logits, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            step += 1

            if it % 100 == 0:
                logger.info("epoch %d [%d/%d] loss %.4f lr %.3e", epoch, it, steps_per_epoch, loss.item(), lr)

        logger.info("epoch %d 训练耗时 %.1fs", epoch, time.time() - t0)

        if (epoch + 1) % args.eval_freq == 0 or epoch == args.epochs - 1:
            metrics = evaluate(model.module, val_loader, device)
            is_best = metrics["top1"] > best_top1
            best_top1 = max(best_top1, metrics["top1"])
            logger.info("验证 epoch %d: top1 %.2f top5 %.2f loss %.4f (best %.2f)",
                        epoch, metrics["top1"], metrics["top5"], metrics["loss"], best_top1)
            if rank == 0:
                save_checkpoint(os.path.join(args.output, "last.pth"), model, optimizer, epoch, step, best_top1)
                if is_best:
                    save_checkpoint(os.path.join(args.output, "best.pth"), model, optimizer, epoch, step, best_top1)
                with open(os.path.join(args.output, "metrics.jsonl"), "a") as f:
                    f.write(json.dumps({"epoch": epoch, **metrics}) + "\n")
            dist.barrier()

    logger.info("训练结束，最佳 top1 = %.2f", best_top1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
