"""Cassava leaf disease - fold training with timm, multi-GPU.

Adapted from my single-GPU Kaggle notebook (public LB 0.899).
Run one fold at a time:

    torchrun --nproc_per_node=4 01_cassava_timm_fold_train.py --fold 0 --model tf_efficientnet_b4_ns
"""
import argparse
import os
import random
import time

import cv2
import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from albumentations import (CenterCrop, Compose, HorizontalFlip, Normalize,
                            RandomResizedCrop, ShiftScaleRotate, Transpose,
                            VerticalFlip)
from albumentations.pytorch import ToTensorV2
from sklearn.metrics import accuracy_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", default="../input/cassava-leaf-disease-classification")
    p.add_argument("--folds_csv", default="../input/cassava-folds/train_folds.csv")
    p.add_argument("--model", default="tf_efficientnet_b4_ns")
    p.add_argument("--pretrained_path", default="../input/timm-weights/tf_efficientnet_b4_ns.pth")
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--img_size", type=int, default=512)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--num_workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=719)
    p.add_argument("--out_dir", default="./weights")
    p.add_argument("--local_rank", type=int, default=0)
    return p.parse_args()


def seed_everything(seed):
    random.seed(seed)
    os.environ["PYTHONHASHSEED"] = str(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)


def get_train_transforms(size):
    return Compose([
        RandomResizedCrop(size, size),
        Transpose(p=0.5),
        HorizontalFlip(p=0.5),
        VerticalFlip(p=0.5),
        ShiftScaleRotate(p=0.5),
        Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
        ToTensorV2(),
    ])


def get_valid_transforms(size):
    return Compose([
        CenterCrop(size, size, p=1.0),
        Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
        ToTensorV2(),
    ])


class CassavaDataset(Dataset):
    def __init__(self, df, img_dir, transforms=None):
        self.df = df.reset_index(drop=True)
        self.img_dir = img_dir
        self.transforms = transforms

    def __len__(self):
        return len(self.df)

    def __getitem__(self, idx):
        row = self.df.iloc[idx]
        img = cv2.imread(os.path.join(self.img_dir, row.image_id))
        img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
        if self.transforms is not None:
            img = self.transforms(image=img)["image"]
        return img, torch.tensor(row.label, dtype=torch.long), idx


class CassavaClassifier(nn.Module):
    def __init__(self, model_name, n_class, pretrained_path=None):
        super().__init__()
        self.model = timm.create_model(model_name, pretrained=False)
        if pretrained_path and os.path.exists(pretrained_path):
            self.model.load_state_dict(torch.load(pretrained_path, map_location="cpu"))
        n_features = self.model.classifier.in_features
        self.model.classifier = nn.Linear(n_features, n_class)

    def forward(self, x):
        return self.model(x)


def train_one_epoch(epoch, model, loader, optimizer, scheduler, scaler, loss_fn, device, rank):
    model.train()
    running = None
    t0 = time.time()
    for step, (imgs, labels, _) in enumerate(loader):
        imgs = imgs.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():
            preds = model(imgs)
            loss = loss_fn(preds, labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        running = loss.item() if running is None else running * 0.99 + loss.item() * 0.01
        if rank == 0 and (step + 1) % 50 == 0:
            print(f"epoch {epoch} step {step + 1}/{len(loader)} loss {running:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
    scheduler.step()


@torch.no_grad()
def valid_one_epoch(model, loader, device, world_size, n_total):
    model.eval()
    idx_all, pred_all = [], []
    for imgs, _, idx in loader:
        logits = model(imgs.to(device, non_blocking=True))
        pred_all.append(logits.argmax(1).cpu())
        idx_all.append(idx)
    local = (torch.cat(idx_all).numpy(), torch.cat(pred_all).numpy())
    gathered = [None] * world_size
    dist.all_gather_object(gathered, local)
    idx = np.concatenate([g[0] for g in gathered])
    pred = np.concatenate([g[1] for g in gathered])
    # DistributedSampler pads with repeated indices; keep one prediction per image
    _, first = np.unique(idx, return_index=True)
    return idx[first], pred[first]


def main():
    args = get_args()
    local_rank = args.local_rank
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    seed_everything(args.seed)

    folds = pd.read_csv(args.folds_csv)
    trn_df = folds[folds.fold != args.fold]
    val_df = folds[folds.fold == args.fold].reset_index(drop=True)
    img_dir = os.path.join(args.data_dir, "train_images")

    train_ds = CassavaDataset(trn_df, img_dir, get_train_transforms(args.img_size))
    valid_ds = CassavaDataset(val_df, img_dir, get_valid_transforms(args.img_size))
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    valid_sampler = DistributedSampler(valid_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_ds, batch_size=args.batch_size * 2, sampler=valid_sampler,
                              num_workers=args.num_workers, pin_memory=True)

    model = CassavaClassifier(args.model, 5, args.pretrained_path).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * world_size, weight_decay=1e-6)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0=args.epochs, eta_min=1e-6)
    scaler = torch.cuda.amp.GradScaler()
    loss_fn = nn.CrossEntropyLoss().to(device)

    os.makedirs(args.out_dir, exist_ok=True)
    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        train_one_epoch(epoch, model, train_loader, optimizer, scheduler, scaler, loss_fn, device, rank)
        idx, preds = valid_one_epoch(model, valid_loader, device, world_size, len(valid_ds))
        if rank == 0:
            acc = accuracy_score(val_df.label.values[idx], preds)
            print(f"[fold {args.fold}] epoch {epoch} valid acc {acc:.4f}", flush=True)
            if acc > best_acc:
                best_acc = acc
                torch.save(model.module.state_dict(),
                           os.path.join(args.out_dir, f"{args.model}_fold{args.fold}_best.pth"))
                print(f"  saved best ({best_acc:.4f})", flush=True)
        dist.barrier()

    if rank == 0:
        print(f"fold {args.fold} done, best acc {best_acc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
