"""Diabetic retinopathy grading (APTOS 2019 + resized EyePACS) as regression, 5 folds, DDP.

Usage:
    torchrun --nproc_per_node=4 05_aptos_dr_regression.py --cfg cfg/effb5_512.json
"""
import argparse
import json
import os
import time

import cv2
import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import albumentations as A
from albumentations.pytorch import ToTensorV2
from sklearn.metrics import cohen_kappa_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DEFAULT_CFG = {
    "csv": "input/train_folds.csv",
    "img_dir": "input/train_images_512",
    "out_dir": "work/effb5_512",
    "arch": "tf_efficientnet_b5_ns",
    "img_size": 512,
    "n_folds": 5,
    "epochs": 15,
    "batch_size": 12,
    "lr": 1e-4,
    "weight_decay": 1e-5,
    "num_workers": 8,
}
BOUNDS = [0.5, 1.5, 2.5, 3.5]


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    ns = ap.parse_args()
    cfg = dict(DEFAULT_CFG)
    if ns.cfg is not None:
        with open(ns.cfg) as fh:
            cfg.update(json.load(fh))
    return cfg


def ben_graham(img, sigma=10):
    return cv2.addWeighted(img, 4, cv2.GaussianBlur(img, (0, 0), sigma), -4, 128)


class FundusDataset(Dataset):
    def __init__(self, df, img_dir, tf):
        self.codes = df["id_code"].tolist()
        self.grade = df["diagnosis"].to_numpy(np.float32)
        self.rows = df.index.to_numpy()
        self.img_dir = img_dir
        self.tf = tf

    def __len__(self):
        return len(self.codes)

    def __getitem__(self, i):
        img = cv2.imread(os.path.join(self.img_dir, self.codes[i] + ".png"))
        img = ben_graham(cv2.cvtColor(img, cv2.COLOR_BGR2RGB))
        img = self.tf(image=img)["image"]
        return img, self.grade[i], self.rows[i]


def transforms(size, train):
    if not train:
        return A.Compose([A.Resize(size, size), A.Normalize(), ToTensorV2()])
    return A.Compose([
        A.Resize(size, size),
        A.HorizontalFlip(), A.VerticalFlip(),
        A.Rotate(limit=180, border_mode=cv2.BORDER_CONSTANT, value=0),
        A.RandomBrightnessContrast(0.1, 0.1),
        A.Normalize(), ToTensorV2(),
    ])


def to_grade(pred, bounds=BOUNDS):
    return np.digitize(pred, bounds)


@torch.no_grad()
def predict_fold(model, loader, device, world_size):
    model.eval()
    out_rows, out_pred = [], []
    for x, _, rows in loader:
        x = x.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            p = model(x).squeeze(1)
            p = (p + model(x.flip(3)).squeeze(1) + model(x.flip(2)).squeeze(1)) / 3
        out_pred.append(p.float().cpu().numpy())
        out_rows.append(rows.numpy())
    parts = [None] * world_size
    dist.all_gather_object(parts, (np.concatenate(out_rows), np.concatenate(out_pred)))
    rows = np.concatenate([r for r, _ in parts])
    pred = np.concatenate([p for _, p in parts])
    rows, keep = np.unique(rows, return_index=True)
    return rows, pred[keep]


def train_fold(fold, df, cfg, rank, local_rank, world_size):
    device = torch.device(f"cuda:{local_rank}")
    tr_ds = FundusDataset(df[df.fold != fold], cfg["img_dir"], transforms(cfg["img_size"], True))
    va_ds = FundusDataset(df[df.fold == fold], cfg["img_dir"], transforms(cfg["img_size"], False))
    tr_smp = DistributedSampler(tr_ds, shuffle=True)
    va_smp = DistributedSampler(va_ds, shuffle=False)
    tr_dl = DataLoader(tr_ds, cfg["batch_size"], sampler=tr_smp, num_workers=cfg["num_workers"],
                       pin_memory=True, drop_last=True)
    va_dl = DataLoader(va_ds, cfg["batch_size"] * 2, sampler=va_smp, num_workers=cfg["num_workers"],
                       pin_memory=True)

    model = timm.create_model(cfg["arch"], pretrained=True, num_classes=1).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    scheduler = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0=cfg["epochs"], eta_min=1e-6)
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.SmoothL1Loss()

    best_qwk, best = -1.0, None
    for epoch in range(cfg["epochs"]):
        tr_smp.set_epoch(epoch)
        model.train()
        t0 = time.time()
        n_skipped = 0
        loss_meter = torch.zeros(2, device=device)
        for it, (x, y, _) in enumerate(tr_dl):
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                pred = model(x).squeeze(1)
                loss = criterion(pred.float(), y)
            if not torch.isfinite(loss):
                n_skipped += 1
                optimizer.zero_grad(set_to_none=True)
                continue
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step(epoch + it / len(tr_dl))
            loss_meter += torch.tensor([loss.item(), 1.0], device=device)
        dist.all_reduce(loss_meter)

        rows, pred = predict_fold(model, va_dl, device, world_size)
        y_true = df.loc[rows, "diagnosis"].to_numpy()
        qwk = cohen_kappa_score(y_true, to_grade(pred), weights="quadratic")
        if rank == 0:
            print(f"fold{fold} epoch{epoch:02d} loss={loss_meter[0].item() / max(loss_meter[1].item(), 1):.4f} "
                  f"qwk={qwk:.4f} skipped={n_skipped} t={time.time() - t0:.0f}s", flush=True)
            if qwk > best_qwk:
                torch.save(model.module.state_dict(), os.path.join(cfg["out_dir"], f"{cfg['arch']}_fold{fold}.pt"))
        if qwk > best_qwk:
            best_qwk, best = qwk, (rows, pred)
    return best_qwk, best


def optimise_bounds(y, pred):
    bounds = list(BOUNDS)
    for _ in range(3):
        for k in range(4):
            cands = np.linspace(bounds[k] - 0.4, bounds[k] + 0.4, 41)
            scores = [cohen_kappa_score(y, np.digitize(pred, bounds[:k] + [c] + bounds[k + 1:]), weights="quadratic")
                      for c in cands]
            bounds[k] = float(cands[int(np.argmax(scores))])
    return sorted(bounds)


def main():
    cfg = load_config()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    torch.backends.cudnn.benchmark = True
    os.makedirs(cfg["out_dir"], exist_ok=True)

    df = pd.read_csv(cfg["csv"]).reset_index(drop=True)
    oof = np.zeros(len(df), dtype=np.float32)
    for fold in range(cfg["n_folds"]):
        qwk, (rows, pred) = train_fold(fold, df, cfg, rank, local_rank, world_size)
        oof[rows] = pred
        if rank == 0:
            print(f"fold {fold}: best QWK {qwk:.4f}")
        torch.cuda.empty_cache()

    if rank == 0:
        y = df["diagnosis"].to_numpy()
        bounds = optimise_bounds(y, oof)
        print("OOF QWK default", cohen_kappa_score(y, to_grade(oof), weights="quadratic"))
        print("OOF QWK tuned  ", cohen_kappa_score(y, to_grade(oof, bounds), weights="quadratic"), bounds)
        df.assign(oof=oof).to_csv(os.path.join(cfg["out_dir"], "oof.csv"), index=False)
        with open(os.path.join(cfg["out_dir"], "bounds.json"), "w") as fh:
            json.dump(bounds, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
