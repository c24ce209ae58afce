"""
Fine-tune a timm ViT-B/16 on an ImageFolder dataset (train/ and val/ subfolders).

Originally a single-GPU notebook; moved to a script and DDP for the 4xA100 box.

    torchrun --nproc_per_node=4 03_vit_finetune_imagefolder.py \
        --data /datasets/inat_subset --num-classes 500 --epochs 30
"""
import argparse
import json
import logging
import os
import random
import sys
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from timm.data import create_transform, resolve_data_config
from timm.loss import LabelSmoothingCrossEntropy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--model", default="vit_base_patch16_224.augreg_in21k")
    parser.add_argument("--num-classes", type=int, required=True)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64, help="per GPU")
    parser.add_argument("--lr", type=float, default=5e-4, help="for global batch 512, scaled linearly")
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--warmup-epochs", type=int, default=3)
    parser.add_argument("--num-workers", type=int, default=10)
    parser.add_argument("--out", default="runs/vit_ft")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def setup():
    """Initialise the default process group from the torchrun environment."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    return local_rank


def cleanup():
    dist.destroy_process_group()


def is_main_process():
    return dist.get_rank() == 0


def setup_logging(out_dir):
    handlers = [logging.StreamHandler(sys.stdout)]
    if is_main_process():
        handlers.append(logging.FileHandler(os.path.join(out_dir, "train.log")))
    logging.basicConfig(
        level=logging.INFO if is_main_process() else logging.ERROR,
        format=f"[%(asctime)s][rank {dist.get_rank()}] %(message)s",
        handlers=handlers,
    )


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def build_loaders(args, model, world_size, rank):
    data_cfg = resolve_data_config({}, model=model)
    train_tf = create_transform(**data_cfg, is_training=True, auto_augment="rand-m9-mstd0.5-inc1")
    val_tf = create_transform(**data_cfg, is_training=False)

    train_ds = ImageFolder(os.path.join(args.data, "train"), transform=train_tf)
    val_ds = ImageFolder(os.path.join(args.data, "val"), transform=val_tf)

    train_loader = DataLoader(
        train_ds,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.num_workers,
        pin_memory=True,
        drop_last=True,
        persistent_workers=True,
    )
    val_sampler = DistributedSampler(val_ds, num_replicas=world_size, rank=rank,
                                     shuffle=False, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size * 2, sampler=val_sampler,
                            num_workers=args.num_workers, pin_memory=True)
    return train_ds, train_loader, val_loader


def train_one_epoch(model, loader, criterion, optimizer, scheduler, scaler, device, epoch, steps_per_epoch):
    model.train()
    loss_sum = torch.zeros((), device=device)
    pbar = tqdm(loader, total=steps_per_epoch, disable=not is_main_process(), desc=f"train {epoch}")
    for step, (images, labels) in enumerate(pbar):
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)

        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(images)
            loss = criterion(logits, labels)

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step_update(epoch * steps_per_epoch + step + 1)

        loss_sum += loss.detach()
        if is_main_process() and step % 50 == 0:
            pbar.set_postfix(loss=loss.item(), lr=optimizer.param_groups[0]["lr"])

    dist.all_reduce(loss_sum)
    return loss_sum.item() / (steps_per_epoch * dist.get_world_size())


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    counts = torch.zeros(3, device=device)  # correct@1, correct@5, n
    for images, labels in loader:
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(images)
        top5 = logits.topk(5, dim=1).indices
        counts[0] += (top5[:, 0] == labels).sum()
        counts[1] += (top5 == labels[:, None]).any(dim=1).sum()
        counts[2] += labels.numel()
    dist.all_reduce(counts)
    return (100 * counts[0] / counts[2]).item(), (100 * counts[1] / counts[2]).item()


def main():
    args = parse_args()
    local_rank = setup()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    if is_main_process():
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)
    dist.barrier()
    setup_logging(args.out)
    seed_everything(args.seed)

    model = timm.create_model(args.model, pretrained=True, num_classes=args.num_classes,
                              drop_path_rate=0.1)
    train_ds, train_loader, val_loader = build_loaders(args, model, world_size, rank)
    logger.info("train images: %d, classes: %d", len(train_ds), len(train_ds.classes))

    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.lr * args.batch_size * world_size / 512
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.weight_decay)
    steps_per_epoch = len(train_loader)
    from timm.scheduler import CosineLRScheduler
    scheduler = CosineLRScheduler(
        optimizer,
        t_initial=args.epochs * steps_per_epoch,
        warmup_t=args.warmup_epochs * steps_per_epoch,
        warmup_lr_init=1e-6,
        lr_min=1e-6,
        t_in_epochs=False,
    )
    scaler = torch.cuda.amp.GradScaler()
    criterion = LabelSmoothingCrossEntropy(smoothing=0.1)

    best_top1 = 0.0
    for epoch in range(args.epochs):
        t0 = time.time()
        train_loss = train_one_epoch(model, train_loader, criterion, optimizer, scheduler, scaler,
                                     device, epoch, steps_per_epoch)
        top1, top5 = validate(model, val_loader, device)
        logger.info("epoch %d  loss %.4f  top1 %.2f  top5 %.2f  (%.0fs)",
                    epoch, train_loss, top1, top5, time.time() - t0)

        if is_main_process():
            ckpt = {
                "epoch": epoch,
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(),
                "top1": top1,
                "classes": train_ds.classes,
            }
            torch.save(ckpt, os.path.join(args.out, "last.pth"))
            if top1 > best_top1:
                best_top1 = top1
                torch.save(ckpt, os.path.join(args.out, "best.pth"))
                logger.info("saved new best (top1 %.2f)", top1)
        dist.barrier()

    logger.info("finished, best top1 %.2f", best_top1)
    cleanup()


if __name__ == "__main__":
    main()
