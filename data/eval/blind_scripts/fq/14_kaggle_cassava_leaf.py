#!/usr/bin/env python
# coding: utf-8
# Cassava Leaf Disease Classification - EfficientNet-B0, multi-GPU (DDP + mp.spawn)
# converted from notebook; run with:  python 14_kaggle_cassava_leaf.py

import os
import socket
import time

import albumentations as A
import cv2
import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from albumentations.pytorch import ToTensorV2
from sklearn.model_selection import StratifiedKFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class CFG:
    root = "/kaggle/input/cassava-leaf-disease-classification"
    out_dir = "/kaggle/working"
    model_name = "efficientnet_b0"
    img_size = 384
    n_classes = 5
    epochs = 10
    batch_size = 32          # per GPU
    lr = 2e-4                # tuned for 2 GPUs x 32
    fold = 0
    n_folds = 5
    seed = 719
    num_workers = 4


def get_free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class LeafDataset(Dataset):
    def __init__(self, df, img_dir, transforms):
        self.ids = df["image_id"].values
        self.labels = df["label"].values
        self.img_dir = img_dir
        self.transforms = transforms

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        img = cv2.imread(os.path.join(self.img_dir, self.ids[i]))
        img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
        img = self.transforms(image=img)["image"]
        return img, self.labels[i]


def get_transforms(train):
    if train:
        return A.Compose([
            A.RandomResizedCrop(CFG.img_size, CFG.img_size),
            A.Transpose(p=0.5), A.HorizontalFlip(p=0.5), A.VerticalFlip(p=0.5),
            A.ShiftScaleRotate(p=0.5),
            A.HueSaturationValue(0.2, 0.2, 0.2, p=0.5),
            A.Normalize(), ToTensorV2(),
        ])
    return A.Compose([A.Resize(CFG.img_size, CFG.img_size), A.Normalize(), ToTensorV2()])


def make_folds():
    df = pd.read_csv(os.path.join(CFG.root, "train.csv"))
    skf = StratifiedKFold(n_splits=CFG.n_folds, shuffle=True, random_state=CFG.seed)
    df["fold"] = -1
    for f, (_, val_idx) in enumerate(skf.split(df, df["label"])):
        df.loc[val_idx, "fold"] = f
    return df


def validate_on_rank0(net, loader, device):
    """Runs on rank 0 only, with the plain module (no DDP forward, no collectives)."""
    net.eval()
    correct, total = 0, 0
    with torch.no_grad(), torch.cuda.amp.autocast():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            correct += (net(x).argmax(1) == y).sum().item()
            total += y.size(0)
    net.train()
    return correct / total


def train_worker(rank, world_size, folds):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(CFG.seed)
    np.random.seed(CFG.seed + rank)

    img_dir = os.path.join(CFG.root, "train_images")
    trn_df = folds[folds.fold != CFG.fold].reset_index(drop=True)
    val_df = folds[folds.fold == CFG.fold].reset_index(drop=True)
    train_ds = LeafDataset(trn_df, img_dir, get_transforms(train=True))
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=CFG.seed)
    train_dl = DataLoader(train_ds, batch_size=CFG.batch_size, sampler=sampler,
                          num_workers=CFG.num_workers, pin_memory=True, drop_last=True)
    val_dl = None
    if rank == 0:
        val_ds = LeafDataset(val_df, img_dir, get_transforms(train=False))
        val_dl = DataLoader(val_ds, batch_size=64, shuffle=False, num_workers=CFG.num_workers)

    # rank 0 fetches the pretrained weights into the cache first, the rest read them afterwards
    if rank == 0:
        model = timm.create_model(CFG.model_name, pretrained=True, num_classes=CFG.n_classes)
    dist.barrier()
    if rank != 0:
        model = timm.create_model(CFG.model_name, pretrained=True, num_classes=CFG.n_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[rank])

    lr = CFG.lr * world_size / 2
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-6)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=CFG.epochs * len(train_dl),
                                                           eta_min=1e-6)
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    best = 0.0
    for epoch in range(CFG.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.cuda.amp.autocast():
                loss = criterion(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 1000.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            loss_sum[0] += loss.detach() * y.size(0)
            loss_sum[1] += y.size(0)
        dist.all_reduce(loss_sum)

        if rank == 0:
            acc = validate_on_rank0(model.module, val_dl, device)
            print(f"Epoch {epoch + 1}/{CFG.epochs} train_loss {(loss_sum[0] / loss_sum[1]).item():.4f} "
                  f"val_acc {acc:.4f} ({time.time() - t0:.0f}s)")
            if acc > best:
                best = acc
                torch.save(model.module.state_dict(),
                           os.path.join(CFG.out_dir, f"{CFG.model_name}_fold{CFG.fold}_best.pth"))
        dist.barrier()

    if rank == 0:
        print(f"fold {CFG.fold} best acc {best:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    folds = make_folds()
    world_size = torch.cuda.device_count()
    # chosen once here; the spawned children inherit these variables
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(get_free_port())
    print(f"{world_size} GPUs, rendezvous on port {os.environ['MASTER_PORT']}")
    mp.spawn(train_worker, args=(world_size, folds), nprocs=world_size, join=True)
