#!/usr/bin/env python
"""Breast ultrasound (BUSI) 3-class classification, stratified k-fold on multiple GPUs.

All folds run inside one torchrun job; out-of-fold probabilities are collected
from every rank and written once at the end.

    torchrun --nproc_per_node=4 01_busi_ultrasound_kfold.py --data-dir /data/busi --out-dir runs/busi_convnext
"""
import argparse
import json
import os
import random
import time

import albumentations as A
import cv2
import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from albumentations.pytorch import ToTensorV2
from sklearn.metrics import balanced_accuracy_score, roc_auc_score
from sklearn.model_selection import StratifiedKFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

CLASSES = ["benign", "malignant", "normal"]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", required=True)
    p.add_argument("--out-dir", default="runs/busi")
    p.add_argument("--arch", default="convnext_tiny.fb_in22k")
    p.add_argument("--img-size", type=int, default=320)
    p.add_argument("--folds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--batch-size", type=int, default=16, help="per GPU")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--wd", type=float, default=0.05)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--seed", type=int, default=2024)
    return p.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def build_index(data_dir):
    rows = []
    for label, cls in enumerate(CLASSES):
        cls_dir = os.path.join(data_dir, cls)
        for fn in sorted(os.listdir(cls_dir)):
            if "_mask" in fn or not fn.endswith(".png"):
                continue
            rows.append({"path": os.path.join(cls_dir, fn), "label": label})
    return pd.DataFrame(rows)


class BUSIDataset(Dataset):
    def __init__(self, df, transform):
        self.paths = df["path"].tolist()
        self.labels = df["label"].to_numpy()
        self.index = df.index.to_numpy()
        self.transform = transform

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = cv2.imread(self.paths[i], cv2.IMREAD_COLOR)
        img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
        img = self.transform(image=img)["image"]
        return img, int(self.labels[i]), int(self.index[i])


def get_transforms(size, train):
    if train:
        return A.Compose([
            A.RandomResizedCrop(size, size, scale=(0.75, 1.0), ratio=(0.85, 1.15)),
            A.HorizontalFlip(p=0.5),
            A.ShiftScaleRotate(shift_limit=0.05, scale_limit=0.1, rotate_limit=15, p=0.5),
            A.RandomBrightnessContrast(0.15, 0.15, p=0.5),
            A.GaussNoise(p=0.2),
            A.Normalize(),
            ToTensorV2(),
        ])
    return A.Compose([A.Resize(size, size), A.Normalize(), ToTensorV2()])


def gather_predictions(idx, probs, world_size):
    buf = [None] * world_size
    dist.all_gather_object(buf, (idx, probs))
    all_idx = np.concatenate([b[0] for b in buf])
    all_probs = np.concatenate([b[1] for b in buf])
    # DistributedSampler repeats a few samples so every rank gets the same count
    _, keep = np.unique(all_idx, return_index=True)
    return all_idx[keep], all_probs[keep]


@torch.no_grad()
def predict(model, loader, device, tta=True):
    model.eval()
    idx_list, prob_list = [], []
    for x, _, idx in loader:
        x = x.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
            if tta:
                logits = logits + model(torch.flip(x, dims=[3]))
                logits = logits / 2
        prob_list.append(F.softmax(logits.float(), dim=1).cpu().numpy())
        idx_list.append(idx.numpy())
    return np.concatenate(idx_list), np.concatenate(prob_list)


def run_fold(fold, df, args, rank, local_rank, world_size):
    device = torch.device("cuda", local_rank)
    train_df = df[df.fold != fold]
    valid_df = df[df.fold == fold]

    train_ds = BUSIDataset(train_df, get_transforms(args.img_size, True))
    valid_ds = BUSIDataset(valid_df, get_transforms(args.img_size, False))
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    valid_sampler = DistributedSampler(valid_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_ds, batch_size=args.batch_size * 2, sampler=valid_sampler,
                              num_workers=args.workers, pin_memory=True)

    model = timm.create_model(args.arch, pretrained=True, num_classes=len(CLASSES), drop_path_rate=0.1)
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wd)
    total_steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total_steps,
                                                    pct_start=0.1)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)

    best_score, best_probs, best_idx = -1.0, None, None
    ckpt_path = os.path.join(args.out_dir, f"fold{fold}_best.pth")
    for epoch in range(args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for x, y, _ in train_loader:
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            optimizer.step()
            scheduler.step()
            running += torch.stack([loss.detach().float() * x.size(0),
                                    torch.tensor(float(x.size(0)), device=device)])
        dist.all_reduce(running)
        train_loss = (running[0] / running[1]).item()

        idx, probs = predict(model, valid_loader, device)
        idx, probs = gather_predictions(idx, probs, world_size)
        y_true = df.loc[idx, "label"].to_numpy()
        bacc = balanced_accuracy_score(y_true, probs.argmax(1))
        auc = roc_auc_score(y_true, probs, multi_class="ovr")
        score = (bacc + auc) / 2

        if rank == 0:
            print(f"fold {fold} ep {epoch:02d} loss {train_loss:.4f} bacc {bacc:.4f} auc {auc:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if score > best_score:
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "score": score}, ckpt_path)
        if score > best_score:
            best_score, best_probs, best_idx = score, probs, idx

    return best_score, best_idx, best_probs


def main():
    args = parse_args()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    # different augmentation stream on every rank
    seed_everything(args.seed + rank)
    os.makedirs(args.out_dir, exist_ok=True)

    df = build_index(args.data_dir)
    df["fold"] = -1
    skf = StratifiedKFold(n_splits=args.folds, shuffle=True)
    for f, (_, va) in enumerate(skf.split(df, df["label"])):
        df.loc[va, "fold"] = f

    oof = np.zeros((len(df), len(CLASSES)), dtype=np.float32)
    scores = {}
    for fold in range(args.folds):
        score, idx, probs = run_fold(fold, df, args, rank, local_rank, world_size)
        oof[idx] = probs
        scores[fold] = score
        torch.cuda.empty_cache()
        dist.barrier()

    if rank == 0:
        y = df["label"].to_numpy()
        cv = {
            "bacc": balanced_accuracy_score(y, oof.argmax(1)),
            "auc": roc_auc_score(y, oof, multi_class="ovr"),
            "folds": scores,
        }
        print("CV:", cv)
        out = df.copy()
        for c, name in enumerate(CLASSES):
            out[f"p_{name}"] = oof[:, c]
        out.to_csv(os.path.join(args.out_dir, "oof.csv"), index=False)
        with open(os.path.join(args.out_dir, "cv.json"), "w") as fh:
            json.dump(cv, fh, indent=2)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
