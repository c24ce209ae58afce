"""DeiT-S distilled (hard distillation from a RegNetY-16GF teacher) on ImageNet-1k.

    torchrun --nproc_per_node=8 10_deit_distill.py --teacher-path /ckpt/regnety_160.pth
"""
import argparse
import datetime
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchvision import datasets, transforms

import timm
from timm.data import Mixup, create_transform
from timm.data.distributed_sampler import RepeatAugSampler
from timm.loss import SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import CosineLRScheduler
from timm.utils import ModelEmaV2, NativeScaler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-path", default="/datasets/imagenet")
    p.add_argument("--output-dir", default="/checkpoint/deit_s_distilled")
    p.add_argument("--model", default="deit_small_distilled_patch16_224")
    p.add_argument("--teacher-model", default="regnety_160")
    p.add_argument("--teacher-path", required=True)
    p.add_argument("--distillation-alpha", type=float, default=0.5)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--lr", type=float, default=5e-4, help="for a global batch of 512")
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--drop-path", type=float, default=0.1)
    p.add_argument("--ema-decay", type=float, default=0.99996)
    p.add_argument("--num-workers", type=int, default=10)
    p.add_argument("--resume", default="")
    return p.parse_args()


class HardDistillationLoss(nn.Module):
    def __init__(self, base_criterion, teacher, alpha):
        super().__init__()
        self.base_criterion = base_criterion
        self.teacher = teacher
        self.alpha = alpha

    def forward(self, inputs, outputs, labels):
        outputs_cls, outputs_dist = outputs
        base_loss = self.base_criterion(outputs_cls, labels)
        with torch.no_grad():
            teacher_outputs = self.teacher(inputs)
        distill_loss = F.cross_entropy(outputs_dist, teacher_outputs.argmax(dim=1))
        return base_loss * (1 - self.alpha) + distill_loss * self.alpha


@torch.no_grad()
def evaluate(loader, model, device):
    """Single-process evaluation over the full validation set."""
    model.eval()
    correct = total = 0
    for images, target in loader:
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            output = model(images)
        correct += (output.argmax(1) == target).sum().item()
        total += target.numel()
    return 100.0 * correct / total


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(rank)

    train_tf = create_transform(224, is_training=True, color_jitter=0.4, auto_augment="rand-m9-mstd0.5-inc1",
                                interpolation="bicubic", re_prob=0.25, re_mode="pixel", re_count=1)
    val_tf = transforms.Compose([
        transforms.Resize(256, interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.CenterCrop(224), transforms.ToTensor(),
        transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    train_set = datasets.ImageFolder(os.path.join(args.data_path, "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data_path, "val"), val_tf)

    sampler_train = RepeatAugSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, num_repeats=3)
    loader_train = DataLoader(train_set, sampler=sampler_train, batch_size=args.batch_size,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    loader_val = None
    if rank == 0:
        loader_val = DataLoader(val_set, batch_size=256, shuffle=False, num_workers=args.num_workers,
                                pin_memory=True)

    model = timm.create_model(args.model, num_classes=1000, drop_path_rate=args.drop_path)
    model.set_distilled_training(True)
    model.to(device)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    model_without_ddp = model.module
    model_ema = ModelEmaV2(model_without_ddp, decay=args.ema_decay)

    teacher = timm.create_model(args.teacher_model, num_classes=1000)
    teacher.load_state_dict(torch.load(args.teacher_path, map_location="cpu")["model"])
    teacher.to(device).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)

    args.lr = args.lr * args.batch_size * world_size / 512.0
    optimizer = create_optimizer_v2(model_without_ddp, opt="adamw", lr=args.lr, weight_decay=args.weight_decay)
    lr_scheduler = CosineLRScheduler(optimizer, t_initial=args.epochs, lr_min=1e-5, warmup_t=args.warmup_epochs,
                                     warmup_lr_init=1e-6)
    loss_scaler = NativeScaler()
    mixup_fn = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=1000)
    criterion = HardDistillationLoss(SoftTargetCrossEntropy(), teacher, args.distillation_alpha)

    out = Path(args.output_dir)
    start_epoch = 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        model_without_ddp.load_state_dict(ck["model"])
        model_ema.module.load_state_dict(ck["model_ema"])
        optimizer.load_state_dict(ck["optimizer"])
        lr_scheduler.load_state_dict(ck["lr_scheduler"])
        loss_scaler.load_state_dict(ck["scaler"])
        start_epoch = ck["epoch"] + 1
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)

    max_acc = 0.0
    t0 = time.time()
    for epoch in range(start_epoch, args.epochs):
        sampler_train.set_epoch(epoch)
        model.train()
        for it, (samples, targets) in enumerate(loader_train):
            samples = samples.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            samples, targets = mixup_fn(samples, targets)
            with torch.autocast("cuda", dtype=torch.float16):
                outputs = model(samples)
                loss = criterion(samples, outputs, targets)
            optimizer.zero_grad()
            loss_scaler(loss, optimizer, parameters=model.parameters())
            model_ema.update(model_without_ddp)
            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} it {it}/{len(loader_train)} loss {loss.item():.4f} "
                      f"lr {optimizer.param_groups[0]['lr']:.2e}")
        lr_scheduler.step(epoch + 1)

        if rank == 0:
            # distilled model averages both heads in eval mode; no collectives in here
            acc = evaluate(loader_val, model_without_ddp, device)
            ema_acc = evaluate(loader_val, model_ema.module, device)
            max_acc = max(max_acc, acc)
            print(f"epoch {epoch}: acc1 {acc:.2f} ema {ema_acc:.2f} max {max_acc:.2f}")
            torch.save({"model": model_without_ddp.state_dict(), "model_ema": model_ema.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "lr_scheduler": lr_scheduler.state_dict(),
                        "scaler": loss_scaler.state_dict(), "epoch": epoch}, out / "checkpoint.pth")
            with open(out / "log.txt", "a") as f:
                f.write(json.dumps({"epoch": epoch, "acc1": acc, "ema_acc1": ema_acc}) + "\n")
            model.train()
        dist.barrier()

    if rank == 0:
        print("Training time", datetime.timedelta(seconds=int(time.time() - t0)))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
