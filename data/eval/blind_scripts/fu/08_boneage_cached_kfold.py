#!/usr/bin/env python
"""RSNA Pediatric Bone Age: k-fold regression with sex input, trained with DDP.

Raw hand radiographs are large PNGs (up to 2000x2500). They are cropped/resized once
to a uint8 .npy cache so the data loaders are not CPU bound.

Launch (one 8-GPU node):
    torchrun --nproc_per_node=8 08_boneage_cached_kfold.py --raw-dir /mnt/data/boneage/train \
        --labels /mnt/data/boneage/train.csv --cache-dir /mnt/data/boneage/cache_640
"""
import argparse
import os
import time

import cv2
import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.model_selection import StratifiedKFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--raw-dir", required=True)
    ap.add_argument("--labels", required=True)
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--out-dir", default="runs/boneage")
    ap.add_argument("--size", type=int, default=640)
    ap.add_argument("--arch", default="inception_v3.tv_in1k")
    ap.add_argument("--n-folds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=12)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--workers", type=int, default=6)
    return ap.parse_args()


def preprocess(path, size):
    img = cv2.imread(path, cv2.IMREAD_GRAYSCALE)
    clahe = cv2.createCLAHE(clipLimit=2.0, tileGridSize=(8, 8))
    img = clahe.apply(img)
    h, w = img.shape
    s = size / max(h, w)
    img = cv2.resize(img, (int(w * s), int(h * s)), interpolation=cv2.INTER_AREA)
    canvas = np.zeros((size, size), np.uint8)
    y0, x0 = (size - img.shape[0]) // 2, (size - img.shape[1]) // 2
    canvas[y0:y0 + img.shape[0], x0:x0 + img.shape[1]] = img
    return canvas


def prepare_cache(df, raw_dir, cache_dir, size, verbose):
    os.makedirs(cache_dir, exist_ok=True)
    for img_id in tqdm(df["id"].tolist(), disable=not verbose, desc="cache"):
        dst = os.path.join(cache_dir, f"{img_id}.npy")
        if os.path.exists(dst):
            continue
        np.save(dst, preprocess(os.path.join(raw_dir, f"{img_id}.png"), size))


class HandDataset(Dataset):
    def __init__(self, df, cache_dir, train):
        self.ids = df["id"].to_numpy()
        self.age = df["boneage"].to_numpy(np.float32)
        self.male = df["male"].astype(np.float32).to_numpy()
        self.rows = df.index.to_numpy()
        self.cache_dir = cache_dir
        self.train = train

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        img = np.load(os.path.join(self.cache_dir, f"{self.ids[i]}.npy"))
        if self.train:
            ang = np.random.uniform(-20, 20)
            sc = np.random.uniform(0.85, 1.15)
            M = cv2.getRotationMatrix2D((img.shape[1] / 2, img.shape[0] / 2), ang, sc)
            img = cv2.warpAffine(img, M, img.shape[::-1], borderValue=0)
            if np.random.rand() < 0.5:
                img = img[:, ::-1]
        x = torch.from_numpy(np.ascontiguousarray(img)).float().div(255.0)
        x = ((x - 0.5) / 0.25).unsqueeze(0).expand(3, -1, -1)
        return x, torch.tensor([self.male[i]]), torch.tensor(self.age[i]), self.rows[i]


class BoneAgeNet(nn.Module):
    def __init__(self, arch):
        super().__init__()
        self.backbone = timm.create_model(arch, pretrained=True, num_classes=0)
        self.sex_fc = nn.Sequential(nn.Linear(1, 32), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(self.backbone.num_features + 32, 512), nn.ReLU(),
                                  nn.Dropout(0.2), nn.Linear(512, 1))

    def forward(self, x, male):
        return self.head(torch.cat([self.backbone(x), self.sex_fc(male)], 1)).squeeze(1)


AGE_MU, AGE_SD = 127.3, 41.2


def evaluate(model, loader, device, world_size):
    model.eval()
    rows, preds = [], []
    with torch.no_grad():
        for x, male, _, r in loader:
            with torch.autocast("cuda", dtype=torch.float16):
                p = model(x.to(device), male.to(device)) + model(x.flip(3).to(device), male.to(device))
            preds.append((p.float() / 2 * AGE_SD + AGE_MU).cpu().numpy())
            rows.append(r.numpy())
    buf = [None] * world_size
    dist.all_gather_object(buf, (np.concatenate(rows), np.concatenate(preds)))
    rows = np.concatenate([b[0] for b in buf])
    preds = np.concatenate([b[1] for b in buf])
    rows, keep = np.unique(rows, return_index=True)
    return rows, preds[keep]


def train_fold(fold, df, args, rank, local_rank, world_size):
    device = torch.device("cuda", local_rank)
    tr_ds = HandDataset(df[df.fold != fold], args.cache_dir, train=True)
    va_ds = HandDataset(df[df.fold == fold], args.cache_dir, train=False)
    tr_sampler = DistributedSampler(tr_ds, shuffle=True, seed=fold)
    tr_dl = DataLoader(tr_ds, args.batch_size, sampler=tr_sampler, num_workers=args.workers,
                       pin_memory=True, drop_last=True)
    va_dl = DataLoader(va_ds, args.batch_size * 2, sampler=DistributedSampler(va_ds, shuffle=False),
                       num_workers=args.workers, pin_memory=True)

    model = DDP(BoneAgeNet(args.arch).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs,
                                                steps_per_epoch=len(tr_dl), pct_start=0.15)
    scaler = torch.cuda.amp.GradScaler()
    l1 = nn.L1Loss()

    best_mae, best = float("inf"), None
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, male, age, _ in tr_dl:
            x, male, age = x.to(device), male.to(device), age.to(device)
            target = (age - AGE_MU) / AGE_SD
            with torch.autocast("cuda", dtype=torch.float16):
                loss = l1(model(x, male).float(), target)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()

        rows, preds = evaluate(model, va_dl, device, world_size)
        mae = float(np.abs(preds - df.loc[rows, "boneage"].to_numpy()).mean())
        if rank == 0:
            print(f"fold {fold} epoch {epoch:02d} val MAE {mae:.2f} months ({time.time() - t0:.0f}s)", flush=True)
            if mae < best_mae:
                torch.save(model.module.state_dict(), os.path.join(args.out_dir, f"boneage_f{fold}.pt"))
        if mae < best_mae:
            best_mae, best = mae, (rows, preds)
    return best_mae, best


def main():
    args = parse_args()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    os.makedirs(args.out_dir, exist_ok=True)

    df = pd.read_csv(args.labels).reset_index(drop=True)
    prepare_cache(df, args.raw_dir, args.cache_dir, args.size, verbose=(rank == 0))

    # stratify on sex x age bucket
    strat = df["male"].astype(int).astype(str) + "_" + pd.qcut(df["boneage"], 10, labels=False).astype(str)
    skf = StratifiedKFold(n_splits=args.n_folds, shuffle=True, random_state=0)
    df["fold"] = -1
    for f, (_, va) in enumerate(skf.split(df, strat)):
        df.loc[va, "fold"] = f

    oof = np.zeros(len(df), np.float32)
    maes = []
    for fold in range(args.n_folds):
        mae, (rows, preds) = train_fold(fold, df, args, rank, local_rank, world_size)
        oof[rows] = preds
        maes.append(mae)

    if rank == 0:
        print("fold MAE:", [round(m, 2) for m in maes])
        print(f"OOF MAE {np.abs(oof - df['boneage'].to_numpy()).mean():.2f} months")
        df.assign(pred=oof).to_csv(os.path.join(args.out_dir, "oof.csv"), index=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
