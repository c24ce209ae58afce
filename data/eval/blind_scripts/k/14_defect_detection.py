"""Surface-defect classification for the PCB inspection line (EfficientNet-B3, 6 defect classes + OK).

Kubernetes PyTorchJob, 2 pods x 4 GPUs each:
    torchrun --nnodes=2 --nproc_per_node=4 --node_rank=$NODE_RANK --master_addr=$MASTER_ADDR \
        --master_port=23456 14_defect_detection.py --config /etc/train/defects.yaml
"""
import argparse
import logging
import os
import time
from dataclasses import dataclass, field
from typing import List

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

logger = logging.getLogger("defects")


@dataclass
class DefectConfig:
    train_dir: str = "/mnt/pcb/train"
    val_dir: str = "/mnt/pcb/val"
    arch: str = "efficientnet_b3"
    img_size: int = 384
    batch_size: int = 32
    epochs: int = 30
    lr: float = 4e-4
    class_weights: List[float] = field(default_factory=lambda: [0.5, 2.0, 2.0, 1.5, 3.0, 2.5, 2.0])
    ckpt_dir: str = "/mnt/ckpt/defects"
    amp: bool = True


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--local_rank", type=int, default=0, help="set by the launcher")
    p.add_argument("--resume", default="")
    return p.parse_args()


def build_loaders(cfg: DefectConfig):
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(cfg.img_size, scale=(0.6, 1.0)),
        transforms.RandomHorizontalFlip(), transforms.RandomVerticalFlip(),
        transforms.RandomRotation(15), transforms.ColorJitter(0.2, 0.2, 0.1),
        transforms.ToTensor(), transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    val_tf = transforms.Compose([
        transforms.Resize(cfg.img_size), transforms.CenterCrop(cfg.img_size), transforms.ToTensor(),
        transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    train_ds = datasets.ImageFolder(cfg.train_dir, train_tf)
    val_ds = datasets.ImageFolder(cfg.val_dir, val_tf)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=train_sampler, num_workers=8,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=cfg.batch_size * 2, sampler=val_sampler, num_workers=8)
    return train_loader, val_loader, train_sampler, train_ds.classes


@torch.no_grad()
def validate(model, loader, device, n_classes):
    model.eval()
    confusion = torch.zeros(n_classes, n_classes, device=device, dtype=torch.long)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        pred = model(x).argmax(1)
        confusion += torch.bincount(y * n_classes + pred, minlength=n_classes ** 2).view(n_classes, n_classes)
    dist.all_reduce(confusion)
    per_class_recall = confusion.diag().float() / confusion.sum(1).clamp(min=1).float()
    acc = confusion.diag().sum().item() / max(confusion.sum().item(), 1)
    return acc, per_class_recall.cpu().tolist()


def main():
    args = parse_args()
    with open(args.config) as f:
        cfg = DefectConfig(**yaml.safe_load(f))

    local_rank = args.local_rank
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [%(levelname)s] %(message)s")

    train_loader, val_loader, train_sampler, classes = build_loaders(cfg)
    model = timm.create_model(cfg.arch, pretrained=True, num_classes=len(classes), drop_rate=0.3)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    criterion = nn.CrossEntropyLoss(weight=torch.tensor(cfg.class_weights, device=device), label_smoothing=0.05)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=cfg.lr, epochs=cfg.epochs,
                                                    steps_per_epoch=len(train_loader), pct_start=0.1)
    scaler = torch.cuda.amp.GradScaler(enabled=cfg.amp)
    start_epoch, best_acc = 0, 0.0

    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_acc = ckpt["epoch"] + 1, ckpt["best_acc"]

    for epoch in range(start_epoch, cfg.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, seen = time.time(), 0
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=cfg.amp):
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            seen += x.size(0) * world_size
        acc, recalls = validate(model, val_loader, device, len(classes))
        if rank == 0:
            logger.info("epoch %d acc %.4f %.0f img/s recall %s", epoch, acc, seen / (time.time() - t0),
                        {c: round(r, 3) for c, r in zip(classes, recalls)})
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                     "epoch": epoch, "best_acc": max(best_acc, acc), "classes": classes}
            os.makedirs(cfg.ckpt_dir, exist_ok=True)
            torch.save(state, os.path.join(cfg.ckpt_dir, "last.pt"))
            if acc > best_acc:
                torch.save(state, os.path.join(cfg.ckpt_dir, "best.pt"))
        best_acc = max(best_acc, acc)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
