"""DeiT-style hard distillation: DeiT-S with a distillation token, RegNetY-16GF teacher.

torchrun --nproc_per_node=8 12_deit_distill.py --data-path /data/imagenet \
    --teacher-path /ckpt/regnety_160-a5fe301d.pth --output_dir runs/deit_s_dist
"""
import argparse
import json
import math
import os
import time
from pathlib import Path

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from timm.data import create_transform
from timm.loss import LabelSmoothingCrossEntropy
from torch.utils.data import DataLoader
from torchvision import datasets, transforms


def get_args_parser():
    parser = argparse.ArgumentParser("DeiT distillation", add_help=False)
    parser.add_argument("--data-path", default="/data/imagenet", type=str)
    parser.add_argument("--output_dir", default="", type=str)
    parser.add_argument("--model", default="deit_small_distilled_patch16_224", type=str)
    parser.add_argument("--teacher-model", default="regnety_160", type=str)
    parser.add_argument("--teacher-path", type=str, required=True)
    parser.add_argument("--batch-size", default=128, type=int, help="per GPU")
    parser.add_argument("--epochs", default=300, type=int)
    parser.add_argument("--lr", type=float, default=5e-4, help="lr for a total batch of 512")
    parser.add_argument("--min-lr", type=float, default=1e-5)
    parser.add_argument("--warmup-lr", type=float, default=1e-6)
    parser.add_argument("--warmup-epochs", type=int, default=5)
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--smoothing", type=float, default=0.1)
    parser.add_argument("--drop-path", type=float, default=0.1)
    parser.add_argument("--clip-grad", type=float, default=None)
    parser.add_argument("--num_workers", default=10, type=int)
    parser.add_argument("--resume", default="", type=str)
    parser.add_argument("--seed", default=0, type=int)
    return parser


class HardDistillationLoss(nn.Module):
    """0.5 * CE(cls head, label) + 0.5 * CE(dist head, teacher argmax)."""

    def __init__(self, base_criterion, teacher):
        super().__init__()
        self.base_criterion = base_criterion
        self.teacher = teacher

    def forward(self, inputs, outputs, labels):
        outputs_cls, outputs_dist = outputs
        base_loss = self.base_criterion(outputs_cls, labels)
        with torch.no_grad():
            teacher_out = self.teacher(inputs)
        distill_loss = F.cross_entropy(outputs_dist, teacher_out.argmax(dim=1))
        return 0.5 * base_loss + 0.5 * distill_loss


def build_datasets(args):
    train_tf = create_transform(224, is_training=True, color_jitter=0.4, auto_augment="rand-m9-mstd0.5-inc1",
                                interpolation="bicubic", re_prob=0.25, re_mode="pixel", re_count=1)
    eval_tf = transforms.Compose([
        transforms.Resize(256, interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.CenterCrop(224), transforms.ToTensor(),
        transforms.Normalize(timm.data.IMAGENET_DEFAULT_MEAN, timm.data.IMAGENET_DEFAULT_STD)])
    train = datasets.ImageFolder(os.path.join(args.data_path, "train"), transform=train_tf)
    val = datasets.ImageFolder(os.path.join(args.data_path, "val"), transform=eval_tf)
    return train, val


def lr_for_step(step, total, warmup, base_lr, warmup_lr, min_lr):
    if step < warmup:
        return warmup_lr + (base_lr - warmup_lr) * step / warmup
    t = (step - warmup) / max(1, total - warmup)
    return min_lr + 0.5 * (base_lr - min_lr) * (1 + math.cos(math.pi * t))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct, total = 0, 0
    for images, target in loader:
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():
            output = model(images)
        correct += (output.argmax(dim=1) == target).sum().item()
        total += target.size(0)
    counts = torch.tensor([correct, total], dtype=torch.float64)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    return 100.0 * counts[0].item() / counts[1].item()


def main(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)

    dataset_train, dataset_val = build_datasets(args)
    sampler_train = torch.utils.data.DistributedSampler(dataset_train, shuffle=True)
    # no padding for evaluation: each rank takes every world_size-th image
    val_indices = list(range(rank, len(dataset_val), world_size))
    data_loader_train = DataLoader(dataset_train, sampler=sampler_train, batch_size=args.batch_size,
                                   num_workers=args.num_workers, pin_memory=True, drop_last=True)
    data_loader_val = DataLoader(torch.utils.data.Subset(dataset_val, val_indices),
                                 batch_size=int(1.5 * args.batch_size), num_workers=args.num_workers,
                                 pin_memory=True, drop_last=False)

    model = timm.create_model(args.model, pretrained=False, num_classes=1000, drop_path_rate=args.drop_path)
    model.set_distilled_training(True)
    model.to(device)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    model_without_ddp = model.module

    teacher = timm.create_model(args.teacher_model, pretrained=False, num_classes=1000)
    ckpt = torch.load(args.teacher_path, map_location="cpu")
    teacher.load_state_dict(ckpt["model"] if "model" in ckpt else ckpt)
    teacher.to(device).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)

    base_lr = args.lr * args.batch_size * world_size / 512.0
    decay, no_decay = [], []
    for name, p in model_without_ddp.named_parameters():
        if p.ndim <= 1 or name.endswith(".bias") or name in ("pos_embed", "cls_token", "dist_token"):
            no_decay.append(p)
        else:
            decay.append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=base_lr)
    loss_scaler = torch.cuda.amp.GradScaler()
    criterion = HardDistillationLoss(LabelSmoothingCrossEntropy(smoothing=args.smoothing), teacher)

    steps_per_epoch = len(data_loader_train)
    total_steps = args.epochs * steps_per_epoch
    warmup_steps = args.warmup_epochs * steps_per_epoch

    start_epoch, max_accuracy = 0, 0.0
    if args.resume:
        checkpoint = torch.load(args.resume, map_location="cpu")
        model_without_ddp.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        loss_scaler.load_state_dict(checkpoint["scaler"])
        start_epoch = checkpoint["epoch"] + 1
        max_accuracy = checkpoint.get("max_accuracy", 0.0)

    output_dir = Path(args.output_dir)
    if rank == 0 and args.output_dir:
        output_dir.mkdir(parents=True, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        sampler_train.set_epoch(epoch)
        model.train()
        start = time.time()
        for it, (samples, targets) in enumerate(data_loader_train):
            step = epoch * steps_per_epoch + it
            lr = lr_for_step(step, total_steps, warmup_steps, base_lr, args.warmup_lr, args.min_lr)
            for g in optimizer.param_groups:
                g["lr"] = lr
            samples = samples.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)

            with torch.cuda.amp.autocast():
                outputs = model(samples)
                loss = criterion(samples, outputs, targets)

            optimizer.zero_grad(set_to_none=True)
            loss_scaler.scale(loss).backward()
            if args.clip_grad is not None:
                loss_scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            loss_scaler.step(optimizer)
            loss_scaler.update()

            if rank == 0 and it % 100 == 0:
                print(f"Epoch [{epoch}] [{it}/{steps_per_epoch}] lr {lr:.6f} loss {loss.item():.4f} "
                      f"({time.time() - start:.0f}s)", flush=True)

        test_acc = evaluate(model_without_ddp, data_loader_val, device)
        max_accuracy = max(max_accuracy, test_acc)
        if rank == 0:
            print(f"Accuracy of the network on {len(dataset_val)} test images: {test_acc:.2f}% "
                  f"(max {max_accuracy:.2f}%)", flush=True)
            if args.output_dir:
                torch.save({"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                            "scaler": loss_scaler.state_dict(), "epoch": epoch, "max_accuracy": max_accuracy,
                            "args": vars(args)}, output_dir / "checkpoint.pth")
                with (output_dir / "log.txt").open("a") as f:
                    f.write(json.dumps({"epoch": epoch, "test_acc1": test_acc, "lr": lr}) + "\n")

    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser("DeiT training", parents=[get_args_parser()])
    main(parser.parse_args())
