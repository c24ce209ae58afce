# -*- coding: utf-8 -*-
"""
ViT-B/16 在自有商品图片数据集上微调（DDP 多卡）。
每个 epoch 结束后验证一次，按验证集准确率保存最优权重，并记录到 TensorBoard。

启动：
    torchrun --standalone --nproc_per_node=8 09_vit_finetune_best_ckpt.py \
        --train-csv data/train.csv --val-csv data/val.csv --img-root /data/goods_images
"""
import argparse
import os
import time

import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from timm.data import create_transform, resolve_data_config
from timm.scheduler import CosineLRScheduler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def parse_args():
    parser = argparse.ArgumentParser("ViT 微调")
    parser.add_argument("--train-csv", required=True)
    parser.add_argument("--val-csv", required=True)
    parser.add_argument("--img-root", required=True)
    parser.add_argument("--model", default="vit_base_patch16_224.augreg_in21k")
    parser.add_argument("--num-classes", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64, help="每张卡的 batch size")
    parser.add_argument("--lr", type=float, default=1e-4, help="全局 batch 512 对应的学习率")
    parser.add_argument("--min-lr", type=float, default=1e-6)
    parser.add_argument("--warmup-epochs", type=int, default=2)
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--output-dir", default="./work_dirs/vit_goods")
    parser.add_argument("--seed", type=int, default=3407)
    return parser.parse_args()


class CsvImageDataset(Dataset):
    """csv 两列：path,label"""

    def __init__(self, csv_path, img_root, transform):
        df = pd.read_csv(csv_path)
        self.paths = df["path"].tolist()
        self.labels = df["label"].astype(int).tolist()
        self.img_root = img_root
        self.transform = transform

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.img_root, self.paths[i])).convert("RGB")
        return self.transform(img), self.labels[i]


def train_one_epoch(model, loader, criterion, optimizer, scheduler, scaler, device, epoch, writer, rank):
    model.train()
    num_steps = len(loader)
    t0 = time.time()
    for it, (images, targets) in enumerate(loader):
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            outputs = model(images)
            loss = criterion(outputs, targets)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step_update(epoch * num_steps + it)

        if rank == 0 and it % 50 == 0:
            lr = optimizer.param_groups[0]["lr"]
            print(f"Epoch[{epoch}] [{it}/{num_steps}] loss: {loss.item():.4f} lr: {lr:.2e} "
                  f"耗时: {time.time() - t0:.1f}s", flush=True)
            writer.add_scalar("train/loss", loss.item(), epoch * num_steps + it)
            writer.add_scalar("train/lr", lr, epoch * num_steps + it)


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    criterion = nn.CrossEntropyLoss()
    correct, total, loss_sum = 0, 0, 0.0
    for images, targets in loader:
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            outputs = model(images)
        loss_sum += criterion(outputs.float(), targets).item() * targets.size(0)
        correct += (outputs.argmax(dim=1) == targets).sum().item()
        total += targets.size(0)
    acc = correct / total
    return acc, loss_sum / total


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(args.seed + rank)

    model = timm.create_model(args.model, pretrained=True, num_classes=args.num_classes)
    data_cfg = resolve_data_config({}, model=model)
    train_tf = create_transform(**data_cfg, is_training=True, auto_augment="rand-m9-mstd0.5-inc1")
    val_tf = create_transform(**data_cfg, is_training=False)

    train_set = CsvImageDataset(args.train_csv, args.img_root, train_tf)
    val_set = CsvImageDataset(args.val_csv, args.img_root, val_tf)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size * 2, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    # 学习率按全局 batch 线性缩放
    lr = args.lr * args.batch_size * world_size / 512
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.weight_decay)
    steps_per_epoch = len(train_loader)
    scheduler = CosineLRScheduler(optimizer, t_initial=args.epochs * steps_per_epoch, lr_min=args.min_lr,
                                  warmup_t=args.warmup_epochs * steps_per_epoch, warmup_lr_init=1e-7,
                                  t_in_epochs=False)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    scaler = torch.cuda.amp.GradScaler()

    writer = None
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.output_dir, "tb"))
        print(f"训练集 {len(train_set)} 张，验证集 {len(val_set)} 张，卡数 {world_size}，学习率 {lr:.2e}")

    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        train_one_epoch(model, train_loader, criterion, optimizer, scheduler, scaler,
                        device, epoch, writer, rank)
        val_acc, val_loss = validate(model.module, val_loader, device)

        if rank == 0:
            writer.add_scalar("val/acc", val_acc, epoch)
            writer.add_scalar("val/loss", val_loss, epoch)
            print(f"==> Epoch {epoch} 验证集 acc: {val_acc * 100:.2f}%  loss: {val_loss:.4f}", flush=True)
            state = {"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scaler": scaler.state_dict(), "val_acc": val_acc}
            torch.save(state, os.path.join(args.output_dir, "latest.pth"))
            if val_acc > best_acc:
                best_acc = val_acc
                torch.save(state, os.path.join(args.output_dir, "best.pth"))
                print(f"==> 保存最优模型，acc = {best_acc * 100:.2f}%", flush=True)
        dist.barrier()

    if rank == 0:
        print(f"训练完成，最优验证集准确率 {best_acc * 100:.2f}%")
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
