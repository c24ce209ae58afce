#!/usr/bin/env python3
"""
Skin lesion classification (ISIC-2019 style, 8 diagnostic classes, heavy imbalance).
EfficientNetV2-S from timm, weighted sampling-free setup with class-weighted CE.

DDP version of the Kaggle-notebook training code:
    torchrun --nproc_per_node=4 20_skin_lesion_effnetv2.py --csv data/isic2019/train_folds.csv \
        --img-dir data/isic2019/images --fold 0
"""
import argparse
import logging
import os
import random
import time

import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from sklearn.metrics import balanced_accuracy_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from tqdm import tqdm

CLASSES = ["MEL", "NV", "BCC", "AK", "BKL", "DF", "VASC", "SCC"]


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", required=True, help="image,label,fold columns")
    ap.add_argument("--img-dir", required=True)
    ap.add_argument("--fold", type=int, default=0)
    ap.add_argument("--model", default="tf_efficientnetv2_s.in21k_ft_in1k")
    ap.add_argument("--img-size", type=int, default=384)
    ap.add_argument("--batch-size", type=int, default=24, help="per GPU")
    ap.add_argument("--lr", type=float, default=3e-4, help="for 4 GPUs x 24")
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--out-dir", default="models/isic")
    ap.add_argument("--seed", type=int, default=42)
    return ap.parse_args()


def setup_distributed():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return local_rank


def cleanup_distributed():
    dist.destroy_process_group()


def is_main_process():
    return dist.get_rank() == 0


def get_logger(out_dir):
    logger = logging.getLogger("isic")
    logger.setLevel(logging.INFO if is_main_process() else logging.WARNING)
    fmt = logging.Formatter("%(asctime)s %(message)s")
    sh = logging.StreamHandler()
    sh.setFormatter(fmt)
    logger.addHandler(sh)
    if is_main_process():
        fh = logging.FileHandler(os.path.join(out_dir, "train.log"))
        fh.setFormatter(fmt)
        logger.addHandler(fh)
    return logger


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class LesionDataset(Dataset):
    def __init__(self, df, img_dir, transform):
        self.images = df["image"].tolist()
        self.labels = df["label"].map({c: i for i, c in enumerate(CLASSES)}).tolist()
        self.img_dir = img_dir
        self.transform = transform

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.img_dir, self.images[i] + ".jpg")).convert("RGB")
        return self.transform(img), self.labels[i]


def build_transforms(size):
    norm = transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(size, scale=(0.6, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.RandomVerticalFlip(),
        transforms.RandomRotation(30),
        transforms.ColorJitter(0.2, 0.2, 0.15, 0.02),
        transforms.ToTensor(),
        norm,
    ])
    val_tf = transforms.Compose([transforms.Resize((size, size)), transforms.ToTensor(), norm])
    return train_tf, val_tf


@torch.no_grad()
def validate(model, loader, criterion, device):
    model.eval()
    probs, targets, losses = [], [], []
    for images, labels in loader:
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(images)
        losses.append(criterion(logits.float(), labels).item())
        probs.append(logits.float().softmax(1).cpu())
        targets.append(labels.cpu())
    probs = torch.cat(probs).numpy()
    targets = torch.cat(targets).numpy()
    bal_acc = balanced_accuracy_score(targets, probs.argmax(1))
    mel_auc = roc_auc_score(targets == 0, probs[:, 0])
    return float(np.mean(losses)), bal_acc, mel_auc


def main():
    args = parse_args()
    local_rank = setup_distributed()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    if is_main_process():
        os.makedirs(args.out_dir, exist_ok=True)
    dist.barrier()
    logger = get_logger(args.out_dir)
    seed_everything(args.seed)

    df = pd.read_csv(args.csv)
    train_df = df[df["fold"] != args.fold].reset_index(drop=True)
    val_df = df[df["fold"] == args.fold].reset_index(drop=True)
    train_tf, val_tf = build_transforms(args.img_size)
    train_ds = LesionDataset(train_df, args.img_dir, train_tf)
    val_ds = LesionDataset(val_df, args.img_dir, val_tf)

    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=8, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size * 2, sampler=val_sampler,
                            num_workers=8, pin_memory=True)

    # inverse-frequency class weights from the training split
    counts = np.bincount(train_ds.labels, minlength=len(CLASSES))
    class_w = torch.tensor(counts.sum() / (len(CLASSES) * np.maximum(counts, 1)), dtype=torch.float32)
    criterion = nn.CrossEntropyLoss(weight=class_w.to(device))

    model = timm.create_model(args.model, pretrained=True, num_classes=len(CLASSES), drop_rate=0.3)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model.to(device), device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, pct_start=0.1,
                                                    total_steps=args.epochs * len(train_loader))
    logger.info("fold %d: %d train / %d val, %d GPUs", args.fold, len(train_ds), len(val_ds), world_size)

    best_score = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_acc = torch.zeros(1, device=device)
        for images, labels in tqdm(train_loader, disable=not is_main_process(), desc=f"ep {epoch}"):
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(images)
            loss = criterion(logits.float(), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            loss_acc += loss.detach()
        dist.all_reduce(loss_acc)
        train_loss = loss_acc.item() / (len(train_loader) * world_size)

        val_loss, bal_acc, mel_auc = validate(model, val_loader, criterion, device)
        if is_main_process():
            logger.info("epoch %02d | train %.4f | val %.4f | bal_acc %.4f | MEL auc %.4f | %.0fs",
                        epoch, train_loss, val_loss, bal_acc, mel_auc, time.time() - t0)
            if bal_acc > best_score:
                best_score = bal_acc
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "bal_acc": bal_acc,
                            "classes": CLASSES}, os.path.join(args.out_dir, f"best_fold{args.fold}.pth"))
                logger.info("  -> new best balanced accuracy %.4f", bal_acc)
        dist.barrier()

    logger.info("fold %d done, best balanced acc %.4f", args.fold, best_score)
    cleanup_distributed()


if __name__ == "__main__":
    main()
