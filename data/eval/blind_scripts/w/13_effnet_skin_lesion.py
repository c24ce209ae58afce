"""
Skin lesion classification (HAM10000, 7 classes) with timm EfficientNet-B3.
Multi-GPU DistributedDataParallel version.

usage:
    torchrun --nproc_per_node=4 13_effnet_skin_lesion.py --img_dir data/ham10000/images \
        --meta data/ham10000/HAM10000_metadata.csv
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from sklearn.metrics import balanced_accuracy_score
from sklearn.model_selection import GroupShuffleSplit
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from tqdm import tqdm

CLASSES = ["akiec", "bcc", "bkl", "df", "mel", "nv", "vasc"]


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--img_dir", type=str, required=True)
    parser.add_argument("--meta", type=str, required=True)
    parser.add_argument("--arch", type=str, default="efficientnet_b3")
    parser.add_argument("--img_size", type=int, default=300)
    parser.add_argument("--epochs", type=int, default=25)
    parser.add_argument("--batch_size", type=int, default=24)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--save_dir", type=str, default="checkpoints_ham")
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


class LesionDataset(Dataset):
    def __init__(self, df, img_dir, transform):
        self.paths = [os.path.join(img_dir, f"{i}.jpg") for i in df.image_id]
        self.labels = df.dx.map({c: i for i, c in enumerate(CLASSES)}).values
        self.transform = transform

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, idx):
        img = Image.open(self.paths[idx]).convert("RGB")
        return self.transform(img), int(self.labels[idx])


def build_transforms(size):
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(size, scale=(0.7, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.RandomVerticalFlip(),
        transforms.RandomRotation(20),
        transforms.ColorJitter(0.1, 0.1, 0.1, 0.02),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    val_tf = transforms.Compose([
        transforms.Resize((size, size)),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    return train_tf, val_tf


def split_by_lesion(meta_csv, seed=0):
    # several images per lesion -> split on lesion_id so nothing leaks into val
    df = pd.read_csv(meta_csv)
    gss = GroupShuffleSplit(n_splits=1, test_size=0.15, random_state=seed)
    tr_idx, va_idx = next(gss.split(df, groups=df.lesion_id))
    return df.iloc[tr_idx].reset_index(drop=True), df.iloc[va_idx].reset_index(drop=True)


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    train_df, val_df = split_by_lesion(args.meta)
    train_tf, val_tf = build_transforms(args.img_size)
    train_ds = LesionDataset(train_df, args.img_dir, train_tf)
    val_ds = LesionDataset(val_df, args.img_dir, val_tf)

    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=64, shuffle=False, num_workers=args.workers, pin_memory=True)

    model = timm.create_model(args.arch, pretrained=True, num_classes=len(CLASSES))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    # class-balanced loss, nv is ~67% of the data
    counts = np.bincount(train_ds.labels, minlength=len(CLASSES))
    class_w = torch.tensor((1.0 / counts) / (1.0 / counts).sum() * len(CLASSES), dtype=torch.float32, device=device)
    criterion = nn.CrossEntropyLoss(weight=class_w)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, epochs=args.epochs,
                                                    steps_per_epoch=len(train_loader))
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        print(f"world size {world_size}: {len(train_ds)} train / {len(val_ds)} val images")

    best_bacc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        start = time.time()
        epoch_loss = torch.zeros(2, device=device)
        for images, labels in tqdm(train_loader, disable=rank != 0, desc=f"[{epoch + 1}/{args.epochs}]"):
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(model(images), labels)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            epoch_loss += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        dist.all_reduce(epoch_loss)

        if rank == 0:
            model.eval()
            preds, gts = [], []
            with torch.no_grad():
                for images, labels in val_loader:
                    logits = model.module(images.to(device, non_blocking=True))
                    preds.append(logits.argmax(1).cpu())
                    gts.append(labels)
            preds, gts = torch.cat(preds).numpy(), torch.cat(gts).numpy()
            bacc = balanced_accuracy_score(gts, preds)
            acc = (preds == gts).mean()
            print(f"epoch {epoch + 1}: loss {(epoch_loss[0] / epoch_loss[1]).item():.4f} "
                  f"val acc {acc:.4f} balanced acc {bacc:.4f} ({time.time() - start:.0f}s)")
            if bacc > best_bacc:
                best_bacc = bacc
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "bacc": bacc},
                           os.path.join(args.save_dir, f"{args.arch}_best.pth"))
        dist.barrier()

    if rank == 0:
        print(f"best balanced accuracy: {best_bacc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
