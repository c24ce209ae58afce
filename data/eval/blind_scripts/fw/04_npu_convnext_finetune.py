#!/usr/bin/env python
"""Fine-tune a timm ConvNeXt-T on a product-image dataset on Ascend 910B.

    source /usr/local/Ascend/ascend-toolkit/set_env.sh
    torchrun --nproc_per_node=8 04_npu_convnext_finetune.py \
        --train-dir /data/products/train --val-dir /data/products/val \
        --output /data/exp/convnext_products
"""
import argparse
import logging
import os
import time

import torch
import torch_npu  # noqa: F401  registers the npu device and the hccl backend
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

import timm
from timm.loss import LabelSmoothingCrossEntropy
from timm.scheduler import CosineLRScheduler

log = logging.getLogger(__name__)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-dir", required=True)
    p.add_argument("--val-dir", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--model", default="convnext_tiny.fb_in22k")
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=64, help="per NPU")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=2e-4, help="for a global batch of 512")
    p.add_argument("--min-lr", type=float, default=1e-6)
    p.add_argument("--warmup-epochs", type=int, default=2)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--drop-path", type=float, default=0.1)
    p.add_argument("--smoothing", type=float, default=0.1)
    p.add_argument("--workers", type=int, default=12)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--seed", type=int, default=3407)
    return p.parse_args()


def make_transforms(img_size):
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    train = transforms.Compose([
        transforms.RandomResizedCrop(img_size, scale=(0.35, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.ColorJitter(0.3, 0.3, 0.3),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    val = transforms.Compose([
        transforms.Resize(int(img_size / 0.875)),
        transforms.CenterCrop(img_size),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    return train, val


def setup_dist():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.npu.set_device(local_rank)
    dist.init_process_group(backend="hccl")
    return local_rank, dist.get_rank(), dist.get_world_size()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = torch.zeros(1, device=device)
    total = torch.zeros(1, device=device)
    for images, labels in loader:
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with torch.npu.amp.autocast():
            logits = model(images)
        correct += (logits.argmax(dim=1) == labels).sum()
        total += labels.numel()
    dist.all_reduce(correct)
    dist.all_reduce(total)
    model.train()
    return (correct / total).item()


def main():
    args = get_args()
    local_rank, rank, world_size = setup_dist()
    device = torch.device(f"npu:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(args.seed)

    train_tf, val_tf = make_transforms(args.img_size)
    train_set = datasets.ImageFolder(args.train_dir, transform=train_tf)
    val_set = datasets.ImageFolder(args.val_dir, transform=val_tf)
    assert train_set.classes == val_set.classes
    num_classes = len(train_set.classes)

    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_set, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    model = timm.create_model(args.model, pretrained=True, num_classes=num_classes,
                              drop_path_rate=args.drop_path)
    model = model.to(device)
    model = DDP(model, device_ids=[local_rank])

    global_bs = args.batch_size * world_size
    lr = args.lr * global_bs / 512
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.weight_decay)
    steps_per_epoch = len(train_loader)
    scheduler = CosineLRScheduler(
        optimizer,
        t_initial=args.epochs * steps_per_epoch,
        lr_min=args.min_lr,
        warmup_t=args.warmup_epochs * steps_per_epoch,
        warmup_lr_init=1e-7,
        t_in_epochs=False,
    )
    scaler = torch.npu.amp.GradScaler(enabled=args.amp)
    criterion = LabelSmoothingCrossEntropy(smoothing=args.smoothing)

    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
    log.info("classes=%d world=%d global_bs=%d lr=%.2e", num_classes, world_size, global_bs, lr)

    best_acc, step = 0.0, 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for images, labels in train_loader:
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            with torch.npu.amp.autocast(enabled=args.amp):
                loss = criterion(model(images), labels)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            step += 1
            scheduler.step_update(num_updates=step)
            if step % 50 == 0:
                log.info("ep %d step %d loss %.4f lr %.3e", epoch, step, loss.item(),
                         optimizer.param_groups[0]["lr"])

        acc = evaluate(model, val_loader, device)
        log.info("epoch %d  val_acc %.4f  time %.0fs", epoch, acc, time.time() - t0)
        if rank == 0:
            ckpt = {
                "model": model.module.state_dict(),
                "classes": train_set.classes,
                "epoch": epoch,
                "val_acc": acc,
            }
            torch.save(ckpt, os.path.join(args.output, "last.pth"))
            if acc > best_acc:
                best_acc = acc
                torch.save(ckpt, os.path.join(args.output, "best.pth"))
                log.info("new best %.4f", best_acc)
        dist.barrier()

    log.info("done, best val acc %.4f", best_acc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
