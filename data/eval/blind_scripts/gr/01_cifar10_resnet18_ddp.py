#!/usr/bin/env python3
"""
Train ResNet-18 on CIFAR-10 with DistributedDataParallel.

Converted from the original single-GPU train_cifar.py.

Launch (single node, 4 GPUs):
    torchrun --standalone --nproc_per_node=4 01_cifar10_resnet18_ddp.py --data-dir ./data
"""
import argparse
import logging
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, models, transforms
from tqdm import tqdm

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


def parse_args():
    p = argparse.ArgumentParser(description="CIFAR-10 ResNet-18 (DDP)")
    p.add_argument("--data-dir", default="./data")
    p.add_argument("--output-dir", default="./checkpoints/cifar_r18")
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--batch-size", type=int, default=128, help="per-GPU batch size")
    p.add_argument("--base-lr", type=float, default=0.1, help="LR for a global batch of 256")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--resume", default="")
    return p.parse_args()


# ----------------------------------------------------------------------------
# Distributed helpers
# ----------------------------------------------------------------------------
def setup_distributed():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return dist.get_rank(), local_rank, dist.get_world_size()


def cleanup():
    if dist.is_initialized():
        dist.destroy_process_group()


def is_main_process():
    return not dist.is_initialized() or dist.get_rank() == 0


def get_logger():
    logger = logging.getLogger("cifar")
    level = logging.INFO if is_main_process() else logging.WARNING
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(message)s", level=level)
    return logger


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


# ----------------------------------------------------------------------------
# Model / data
# ----------------------------------------------------------------------------
def build_model(num_classes=10):
    model = models.resnet18(num_classes=num_classes)
    # CIFAR images are 32x32: use a 3x3 stem and drop the max-pool
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def build_datasets(data_dir):
    train_tf = transforms.Compose([
        transforms.RandomCrop(32, padding=4),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(CIFAR_MEAN, CIFAR_STD),
    ])
    test_tf = transforms.Compose([
        transforms.ToTensor(),
        transforms.Normalize(CIFAR_MEAN, CIFAR_STD),
    ])
    # only rank 0 downloads, the others wait and then read the files
    if is_main_process():
        datasets.CIFAR10(data_dir, train=True, download=True)
        datasets.CIFAR10(data_dir, train=False, download=True)
    dist.barrier()
    train_set = datasets.CIFAR10(data_dir, train=True, transform=train_tf, download=False)
    test_set = datasets.CIFAR10(data_dir, train=False, transform=test_tf, download=False)
    return train_set, test_set


def make_lr_lambda(warmup_steps, total_steps):
    def lr_lambda(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr_lambda


# ----------------------------------------------------------------------------
# Train / eval
# ----------------------------------------------------------------------------
def train_one_epoch(model, loader, criterion, optimizer, scheduler, device, epoch):
    model.train()
    running_loss = torch.zeros(1, device=device)
    n_batches = 0
    pbar = tqdm(loader, desc=f"epoch {epoch}", disable=not is_main_process(), leave=False)
    for images, targets in pbar:
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)

        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            outputs = model(images)
            loss = criterion(outputs, targets)

        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()

        running_loss += loss.detach()
        n_batches += 1
        if is_main_process():
            pbar.set_postfix(loss=f"{loss.item():.4f}", lr=f"{scheduler.get_last_lr()[0]:.4f}")

    dist.all_reduce(running_loss, op=dist.ReduceOp.SUM)
    return running_loss.item() / (n_batches * dist.get_world_size())


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    criterion = nn.CrossEntropyLoss(reduction="sum")
    loss_sum = 0.0
    correct = 0
    total = 0
    for images, targets in loader:
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        outputs = model(images)
        loss_sum += criterion(outputs.float(), targets).item()
        correct += (outputs.argmax(dim=1) == targets).sum().item()
        total += targets.size(0)

    # aggregate over all ranks
    stats = torch.tensor([loss_sum, correct, total], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    loss_sum, correct, total = stats.tolist()
    return loss_sum / total, 100.0 * correct / total


def save_checkpoint(path, model, optimizer, scheduler, epoch, best_acc):
    state = {
        "model": model.module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "epoch": epoch,
        "best_acc": best_acc,
    }
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def main():
    args = parse_args()
    rank, local_rank, world_size = setup_distributed()
    device = torch.device("cuda", local_rank)
    logger = get_logger()
    seed_everything(args.seed)
    torch.backends.cudnn.benchmark = True

    if is_main_process():
        os.makedirs(args.output_dir, exist_ok=True)
        logger.info("world_size=%d, per-GPU batch=%d", world_size, args.batch_size)

    train_set, test_set = build_datasets(args.data_dir)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    # every rank evaluates a strided slice of the test set (no padding duplicates)
    test_shard = Subset(test_set, list(range(rank, len(test_set), world_size)))
    test_loader = DataLoader(test_shard, batch_size=256, shuffle=False,
                             num_workers=args.workers, pin_memory=True)

    model = build_model().to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    global_batch = args.batch_size * world_size
    lr = args.base_lr * global_batch / 256
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum,
                                weight_decay=args.weight_decay, nesterov=True)
    steps_per_epoch = len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, make_lr_lambda(args.warmup_epochs * steps_per_epoch, args.epochs * steps_per_epoch))

    start_epoch, best_acc = 0, 0.0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1
        best_acc = ckpt["best_acc"]
        logger.info("resumed from %s at epoch %d", args.resume, start_epoch)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        train_loss = train_one_epoch(model, train_loader, criterion, optimizer, scheduler, device, epoch)
        test_loss, test_acc = evaluate(model, test_loader, device)

        if is_main_process():
            logger.info("epoch %3d | train_loss %.4f | test_loss %.4f | test_acc %.2f%% | %.1fs",
                        epoch, train_loss, test_loss, test_acc, time.time() - t0)
            save_checkpoint(os.path.join(args.output_dir, "last.pt"), model, optimizer, scheduler,
                            epoch, max(best_acc, test_acc))
            if test_acc > best_acc:
                best_acc = test_acc
                torch.save(model.module.state_dict(), os.path.join(args.output_dir, "best_model.pt"))
                logger.info("new best: %.2f%%", best_acc)
        dist.barrier()

    if is_main_process():
        logger.info("done. best test acc %.2f%%", best_acc)
    cleanup()


if __name__ == "__main__":
    main()
