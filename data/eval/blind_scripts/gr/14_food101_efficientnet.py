#!/usr/bin/env python3
"""
Food-101 classification, EfficientNet-B0 (torchvision, ImageNet weights).

Was train_food101.py (single GPU, ~9h). This is the DDP version:
    torchrun --standalone --nproc_per_node=4 14_food101_efficientnet.py --data-root ./data
"""
import argparse
import logging
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
from torchvision import datasets, transforms
from torchvision.models import EfficientNet_B0_Weights, efficientnet_b0
from tqdm import tqdm

logger = logging.getLogger(__name__)


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-root", default="./data")
    parser.add_argument("--epochs", type=int, default=25)
    parser.add_argument("--batch-size", type=int, default=64, help="per GPU")
    parser.add_argument("--lr", type=float, default=0.01, help="SGD lr for a 256 global batch")
    parser.add_argument("--weight-decay", type=float, default=1e-4)
    parser.add_argument("--num-workers", type=int, default=12)
    parser.add_argument("--checkpoint-dir", default="checkpoints/food101")
    parser.add_argument("--seed", type=int, default=17)
    return parser.parse_args()


# ------------------------------------------------------------------ distributed utils
def setup_distributed():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return local_rank


def cleanup_distributed():
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def is_main_process():
    return dist.get_rank() == 0


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


# ------------------------------------------------------------------ data
def get_datasets(root):
    weights = EfficientNet_B0_Weights.IMAGENET1K_V1
    mean, std = weights.transforms().mean, weights.transforms().std
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224),
        transforms.RandomHorizontalFlip(),
        transforms.TrivialAugmentWide(),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
        transforms.RandomErasing(p=0.1),
    ])
    test_tf = transforms.Compose([
        transforms.Resize(256),
        transforms.CenterCrop(224),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    if is_main_process():
        datasets.Food101(root, split="train", download=True)
    dist.barrier()
    train_ds = datasets.Food101(root, split="train", transform=train_tf)
    test_ds = datasets.Food101(root, split="test", transform=test_tf)
    return train_ds, test_ds


# ------------------------------------------------------------------ train / eval
def train_one_epoch(model, loader, criterion, optimizer, device, epoch):
    model.train()
    loss_sum = torch.zeros(1, device=device)
    n = 0
    for images, labels in tqdm(loader, desc=f"Epoch {epoch}", disable=not is_main_process()):
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            outputs = model(images)
            loss = criterion(outputs, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_sum += loss.detach()
        n += 1
    dist.all_reduce(loss_sum)
    return loss_sum.item() / (n * dist.get_world_size())


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = torch.zeros(1, device=device)
    total = torch.zeros(1, device=device)
    for images, labels in loader:
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            outputs = model(images)
        correct += (outputs.argmax(1) == labels).sum()
        total += labels.size(0)
    dist.all_reduce(correct)
    dist.all_reduce(total)
    return (correct / total).item()


def main():
    args = parse_args()
    local_rank = setup_distributed()
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if is_main_process() else logging.WARNING,
                        format="%(asctime)s - %(levelname)s - %(message)s")
    seed_everything(args.seed)

    train_ds, test_ds = get_datasets(args.data_root)
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    test_subset = Subset(test_ds, range(rank, len(test_ds), world_size))
    test_loader = DataLoader(test_subset, batch_size=128, shuffle=False,
                             num_workers=args.num_workers, pin_memory=True)

    model = efficientnet_b0(weights=EfficientNet_B0_Weights.IMAGENET1K_V1)
    model.classifier[1] = nn.Linear(model.classifier[1].in_features, 101)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    lr = args.lr * args.batch_size * world_size / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9,
                                weight_decay=args.weight_decay, nesterov=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    if is_main_process():
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        logger.info("Train: %d imgs, Test: %d imgs, GPUs: %d, lr: %.4f",
                    len(train_ds), len(test_ds), world_size, lr)

    best_acc = 0.0
    for epoch in range(args.epochs):
        start = time.time()
        train_loss = train_one_epoch(model, train_loader, criterion, optimizer, device, epoch)
        scheduler.step()
        # eval on the bare module: shards can differ by one image between ranks
        acc = evaluate(model.module, test_loader, device)

        if is_main_process():
            logger.info("Epoch %d/%d | loss %.4f | test acc %.4f | lr %.5f | %.1f min",
                        epoch + 1, args.epochs, train_loss, acc, scheduler.get_last_lr()[0],
                        (time.time() - start) / 60)
            state = {"epoch": epoch, "model": model.module.state_dict(),
                     "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "acc": acc}
            torch.save(state, os.path.join(args.checkpoint_dir, "last.pth"))
            if acc > best_acc:
                best_acc = acc
                torch.save(state, os.path.join(args.checkpoint_dir, "best.pth"))
        dist.barrier()

    if is_main_process():
        logger.info("Best test accuracy: %.4f", best_acc)
    cleanup_distributed()


if __name__ == "__main__":
    main()
