"""EfficientNetV2-S on the wildlife camera-trap set with progressive resizing.

Epochs [0, --switch-epoch) train at --low-res, the rest at --high-res with stronger augmentation
(FixRes-style). Evaluation is always at --high-res.

    accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 19_progressive_resize_effnet.py \
        --data /data/camtrap --low-res 224 --high-res 384 --switch-epoch 12 --epochs 20
"""
import argparse
import json
import os
import time

import torch
import torch.nn as nn
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from torchvision import datasets, models, transforms

logger = get_logger(__name__, log_level="INFO")
NORM = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])


def train_transform(res, strong):
    ops = [transforms.RandomResizedCrop(res, scale=(0.25 if strong else 0.35, 1.0)),
           transforms.RandomHorizontalFlip()]
    if strong:
        ops.append(transforms.RandAugment(num_ops=2, magnitude=12))
    ops += [transforms.ToTensor(), NORM]
    return transforms.Compose(ops)


def eval_transform(res):
    return transforms.Compose([transforms.Resize(int(res / 0.9)), transforms.CenterCrop(res),
                               transforms.ToTensor(), NORM])


def make_train_loader(root, res, strong, batch_size, workers):
    ds = datasets.ImageFolder(os.path.join(root, "train"), train_transform(res, strong))
    return DataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=workers, pin_memory=True,
                      drop_last=True, persistent_workers=True)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/camtrap_effv2")
    ap.add_argument("--low-res", type=int, default=224)
    ap.add_argument("--high-res", type=int, default=384)
    ap.add_argument("--switch-epoch", type=int, default=12)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--bs-low", type=int, default=96)
    ap.add_argument("--bs-high", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=77)
    return ap.parse_args()


@torch.no_grad()
def evaluate(model, loader, accelerator, criterion):
    model.eval()
    correct = total = 0
    loss_sum = 0.0
    for images, labels in loader:
        logits = model(images)
        losses = accelerator.gather_for_metrics(criterion(logits, labels))
        preds, labels = accelerator.gather_for_metrics((logits.argmax(1), labels))
        correct += (preds == labels).sum().item()
        total += labels.numel()
        loss_sum += losses.sum().item()
    model.train()
    return correct / total, loss_sum / total


def main():
    args = parse_args()
    accelerator = Accelerator()
    set_seed(args.seed)

    val_ds = datasets.ImageFolder(os.path.join(args.data, "val"), eval_transform(args.high_res))
    num_classes = len(val_ds.classes)
    val_loader = DataLoader(val_ds, batch_size=64, shuffle=False, num_workers=args.workers, pin_memory=True)
    train_loader = make_train_loader(args.data, args.low_res, False, args.bs_low, args.workers)

    model = models.efficientnet_v2_s(weights=models.EfficientNet_V2_S_Weights.IMAGENET1K_V1)
    model.classifier[1] = nn.Linear(model.classifier[1].in_features, num_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs, eta_min=1e-6)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    eval_criterion = nn.CrossEntropyLoss(reduction="none")

    model, optimizer, train_loader, val_loader = accelerator.prepare(model, optimizer, train_loader, val_loader)
    accelerator.register_for_checkpointing(scheduler)
    if accelerator.is_main_process:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "classes.json"), "w") as f:
            json.dump(val_ds.classes, f)

    best = 0.0
    for epoch in range(args.epochs):
        if epoch == args.switch_epoch:
            logger.info(f"switching to {args.high_res}px training, batch {args.bs_high}")
            train_loader = make_train_loader(args.data, args.high_res, True, args.bs_high, args.workers)
            for g in optimizer.param_groups:
                g["lr"] *= args.bs_high / args.bs_low

        model.train()
        t0 = time.time()
        seen = torch.zeros((), device=accelerator.device)
        loss_acc = torch.zeros((), device=accelerator.device)
        for step, (images, labels) in enumerate(train_loader):
            images = images.to(accelerator.device, non_blocking=True)
            labels = labels.to(accelerator.device, non_blocking=True)
            logits = model(images)
            loss = criterion(logits, labels)
            optimizer.zero_grad(set_to_none=True)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 2.0)
            optimizer.step()
            loss_acc += loss.detach() * labels.size(0)
            seen += labels.size(0)
            if step % 100 == 0:
                logger.info(f"epoch {epoch} step {step}/{len(train_loader)} loss {loss.item():.4f}")
        scheduler.step()
        loss_acc, seen = accelerator.reduce(loss_acc), accelerator.reduce(seen)

        acc, val_loss = evaluate(model, val_loader, accelerator, eval_criterion)
        logger.info(f"epoch {epoch}: train_loss {(loss_acc / seen).item():.4f} val_loss {val_loss:.4f} "
                    f"val_acc {acc:.4f} imgs {int(seen.item())} time {time.time() - t0:.0f}s")

        accelerator.save_state(os.path.join(args.out, "last"))
        if acc > best:
            best = acc
            accelerator.wait_for_everyone()
            accelerator.save(accelerator.unwrap_model(model).state_dict(), os.path.join(args.out, "best.pth"))

    logger.info(f"best val acc {best:.4f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
