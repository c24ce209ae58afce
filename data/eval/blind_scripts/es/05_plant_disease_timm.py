"""Leaf disease classifier (timm backbone) trained with accelerate.

    accelerate launch --multi_gpu --num_processes 4 --mixed_precision fp16 05_plant_disease_timm.py \
        --data-root /datasets/plantvillage --model convnext_tiny.fb_in22k
"""
import argparse
import json
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from accelerate import Accelerator
from accelerate.utils import set_seed
from timm.data import create_transform, resolve_data_config
from timm.loss import LabelSmoothingCrossEntropy
from torch.utils.data import DataLoader
from torchvision.datasets import ImageFolder


class AverageMeter:
    """Running sum/count that can be synchronised across workers."""

    def __init__(self):
        self.sum = 0.0
        self.count = 0

    def update(self, value, n=1):
        self.sum += value * n
        self.count += n

    def synchronize(self):
        if not (dist.is_available() and dist.is_initialized()):
            return
        t = torch.tensor([self.sum, self.count], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        self.sum, self.count = t[0].item(), int(t[1].item())

    @property
    def avg(self):
        return self.sum / max(self.count, 1)

    def reset(self):
        self.sum, self.count = 0.0, 0


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-root", required=True)
    ap.add_argument("--model", default="convnext_tiny.fb_in22k")
    ap.add_argument("--img-size", type=int, default=224)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--wd", type=float, default=0.05)
    ap.add_argument("--smoothing", type=float, default=0.1)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--out", default="runs/plant_disease")
    ap.add_argument("--resume", default=None, help="directory written by save_state")
    ap.add_argument("--seed", type=int, default=3)
    return ap.parse_args()


def main():
    args = get_args()
    accelerator = Accelerator()
    set_seed(args.seed)
    log = accelerator.print

    model = timm.create_model(args.model, pretrained=True, drop_path_rate=0.1)
    data_cfg = resolve_data_config({"input_size": (3, args.img_size, args.img_size)}, model=model)
    train_tf = create_transform(**data_cfg, is_training=True, auto_augment="rand-m9-mstd0.5")
    val_tf = create_transform(**data_cfg, is_training=False)

    train_set = ImageFolder(os.path.join(args.data_root, "train"), transform=train_tf)
    val_set = ImageFolder(os.path.join(args.data_root, "val"), transform=val_tf)
    model.reset_classifier(len(train_set.classes))

    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size * 2, shuffle=False,
                            num_workers=args.workers, pin_memory=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wd)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.lr, epochs=args.epochs, steps_per_epoch=len(train_loader), pct_start=0.1
    )
    train_crit = LabelSmoothingCrossEntropy(smoothing=args.smoothing)
    val_crit = nn.CrossEntropyLoss()

    model, optimizer, train_loader, val_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, val_loader, scheduler
    )

    start_epoch = 0
    if args.resume:
        accelerator.load_state(args.resume)
        with open(os.path.join(args.resume, "meta.json")) as f:
            start_epoch = json.load(f)["epoch"] + 1
        log(f"resumed from {args.resume}, starting at epoch {start_epoch}")

    if accelerator.is_main_process:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "classes.json"), "w") as f:
            json.dump(train_set.classes, f)

    best_acc = 0.0
    loss_meter = AverageMeter()
    for epoch in range(start_epoch, args.epochs):
        model.train()
        loss_meter.reset()
        t0 = time.time()
        for i, (images, targets) in enumerate(train_loader):
            outputs = model(images)
            loss = train_crit(outputs, targets)
            optimizer.zero_grad()
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            loss_meter.update(loss.item(), images.size(0))
            if i % 50 == 0:
                log(f"[{epoch}][{i}/{len(train_loader)}] loss {loss.item():.4f} "
                    f"lr {scheduler.get_last_lr()[0]:.2e}")
        loss_meter.synchronize()
        epoch_time = time.time() - t0

        model.eval()
        val_loss, correct, n = 0.0, 0, 0
        with torch.no_grad():
            for images, targets in val_loader:
                outputs = model(images)
                loss = val_crit(outputs, targets)
                preds = outputs.argmax(dim=1)
                all_preds, all_targets = accelerator.gather_for_metrics((preds, targets))
                all_losses = accelerator.gather_for_metrics(loss.repeat(targets.size(0)))
                correct += (all_preds == all_targets).sum().item()
                n += all_targets.numel()
                val_loss += all_losses.sum().item()
        acc = correct / n
        log(f"epoch {epoch} train_loss {loss_meter.avg:.4f} val_loss {val_loss / n:.4f} "
            f"val_acc {acc:.4f} ({epoch_time:.0f}s)")

        ckpt_dir = os.path.join(args.out, f"epoch_{epoch:03d}")
        accelerator.save_state(ckpt_dir)
        if accelerator.is_main_process:
            with open(os.path.join(ckpt_dir, "meta.json"), "w") as f:
                json.dump({"epoch": epoch, "val_acc": acc}, f)
        if acc > best_acc:
            best_acc = acc
            accelerator.wait_for_everyone()
            accelerator.save(accelerator.unwrap_model(model).state_dict(), os.path.join(args.out, "best.pth"))

    log(f"done, best val acc {best_acc:.4f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
