# -*- coding: utf-8 -*-
"""
OCR 前处理：文本行方向分类（0° / 180°）+ 整图方向分类（0/90/180/270）

backbone 用 torchvision 的 MobileNetV3-Small，部署在端侧，所以模型要小。
标注文件每行：相对路径 \t 方向类别
启动：
    torchrun --nproc_per_node=8 17_ocr_direction_cls.py --task textline \
        --data_root /mnt/nas/ocr/direction --save_dir /mnt/nas/ocr/models/direction_textline_v2
"""
import os
import time
import random
import argparse
import logging

import numpy as np
from PIL import Image
import torch
import torch.nn as nn
import torch.distributed as dist
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

TASKS = {
    "textline": {"num_classes": 2, "size": (48, 192)},
    "image": {"num_classes": 4, "size": (224, 224)},
}


def parse_args():
    parser = argparse.ArgumentParser(description="OCR 方向分类训练")
    parser.add_argument("--task", choices=list(TASKS), default="textline")
    parser.add_argument("--data_root", required=True)
    parser.add_argument("--save_dir", required=True)
    parser.add_argument("--batch_size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


class DirectionDataset(Dataset):
    def __init__(self, root, list_file, size, train):
        self.root = root
        self.samples = []
        with open(list_file, encoding="utf-8") as f:
            for line in f:
                p, c = line.rstrip("\n").split("\t")
                self.samples.append((p, int(c)))
        aug = [T.ColorJitter(0.3, 0.3, 0.3), T.RandomApply([T.GaussianBlur(3)], p=0.2)] if train else []
        self.tf = T.Compose([T.Resize(size)] + aug + [T.ToTensor(), T.Normalize([0.5] * 3, [0.5] * 3)])

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        p, c = self.samples[i]
        img = Image.open(os.path.join(self.root, p)).convert("RGB")
        return self.tf(img), c


def build_model(num_classes):
    m = torchvision.models.mobilenet_v3_small(weights="IMAGENET1K_V1")
    m.classifier[3] = nn.Linear(m.classifier[3].in_features, num_classes)
    return m


def get_logger(rank, save_dir):
    logger = logging.getLogger("direction")
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(message)s")
    sh = logging.StreamHandler()
    sh.setFormatter(fmt)
    logger.addHandler(sh)
    if rank == 0:
        fh = logging.FileHandler(os.path.join(save_dir, "train.log"), encoding="utf-8")
        fh.setFormatter(fmt)
        logger.addHandler(fh)
    return logger


@torch.no_grad()
def evaluate(model, dataset, device, bs):
    rank, world = dist.get_rank(), dist.get_world_size()
    model.eval()
    loader = DataLoader(Subset(dataset, range(rank, len(dataset), world)), batch_size=bs, num_workers=4)
    correct = torch.zeros(1, device=device)
    count = torch.zeros(1, device=device)
    for img, y in loader:
        img, y = img.to(device, non_blocking=True), y.to(device, non_blocking=True)
        correct += (model.module(img).argmax(1) == y).sum()
        count += y.numel()
    dist.all_reduce(correct)
    dist.all_reduce(count)
    model.train()
    return (correct / count).item()


def main():
    args = parse_args()
    task = TASKS[args.task]

    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
    dist.barrier()
    logger = get_logger(rank, args.save_dir)

    root = os.path.join(args.data_root, args.task)
    train_set = DirectionDataset(root, os.path.join(root, "train.txt"), task["size"], train=True)
    val_set = DirectionDataset(root, os.path.join(root, "val.txt"), task["size"], train=False)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)

    model = build_model(task["num_classes"])
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=4e-5, nesterov=True)
    warmup_iters = len(loader)
    total_iters = args.epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.SequentialLR(
        optimizer,
        [torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=warmup_iters),
         torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_iters - warmup_iters)],
        milestones=[warmup_iters])
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (img, y) in enumerate(loader):
            img, y = img.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = criterion(model(img), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            if it % 50 == 0:
                logger.info("[%s] epoch %d it %d/%d loss %.4f lr %.5f %.2fs", args.task, epoch, it, len(loader),
                            loss.item(), optimizer.param_groups[0]["lr"], time.time() - t0)
                t0 = time.time()

        acc = evaluate(model, val_set, device, args.batch_size)
        logger.info("[%s] epoch %d val acc %.4f (best %.4f)", args.task, epoch, acc, best)
        if rank == 0:
            torch.save(model.module.state_dict(), os.path.join(args.save_dir, "last.pth"))
            if acc > best:
                best = acc
                torch.save(model.module.state_dict(), os.path.join(args.save_dir, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
