"""SIIM-FISABIO-RSNA COVID-19, study-level 4-class head (negative / typical / indeterminate / atypical).

5 folds in one torchrun job; each fold builds its own process group. After training a fold
the best checkpoint is reloaded on every rank and the fold's images are re-scored with
8x TTA to produce the out-of-fold predictions used by the stacking stage.

    torchrun --nproc_per_node=4 20_siim_covid_study_folds.py --img-dir data/png_640 --meta data/train_image_folds.csv
"""
import argparse
import os
import time
from datetime import timedelta

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
from sklearn.metrics import average_precision_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

STUDY_CLASSES = ["Negative for Pneumonia", "Typical Appearance", "Indeterminate Appearance", "Atypical Appearance"]


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--img-dir", required=True)
    ap.add_argument("--meta", required=True, help="one row per image, study labels + precomputed 'fold'")
    ap.add_argument("--out", default="runs/covid_study_v2m")
    ap.add_argument("--arch", default="tf_efficientnetv2_m.in21k_ft_in1k")
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--folds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--bs", type=int, default=12)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


class CXR(Dataset):
    def __init__(self, df, img_dir, tf):
        self.paths = [os.path.join(img_dir, f"{i}.png") for i in df.image_id]
        self.y = df[STUDY_CLASSES].to_numpy().argmax(1)
        self.rows = df.index.to_numpy()
        self.tf = tf

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = cv2.imread(self.paths[i])
        return self.tf(image=img)["image"], int(self.y[i]), int(self.rows[i])


def get_tf(size, train):
    if train:
        return A.Compose([
            A.RandomResizedCrop(size, size, scale=(0.8, 1.0)),
            A.HorizontalFlip(p=0.5),
            A.ShiftScaleRotate(0.05, 0.1, 10, border_mode=cv2.BORDER_CONSTANT, p=0.7),
            A.RandomBrightnessContrast(0.2, 0.2, p=0.7),
            A.CLAHE(p=0.2),
            A.Normalize(), ToTensorV2(),
        ])
    return A.Compose([A.Resize(size, size), A.Normalize(), ToTensorV2()])


def tta8(model, x):
    out = 0
    for k in range(4):
        xr = torch.rot90(x, k, (2, 3))
        out = out + F.softmax(model(xr).float(), 1) + F.softmax(model(xr.flip(3)).float(), 1)
    return out / 8


@torch.no_grad()
def predict(model, loader, device, world_size, tta=False):
    model.eval()
    rows, probs = [], []
    for x, _, r in loader:
        x = x.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            p = tta8(model, x) if tta else F.softmax(model(x).float(), 1)
        probs.append(p.cpu().numpy())
        rows.append(r.numpy())
    parts = [None] * world_size
    dist.all_gather_object(parts, (np.concatenate(rows), np.concatenate(probs)))
    rows = np.concatenate([q[0] for q in parts])
    probs = np.concatenate([q[1] for q in parts])
    rows, keep = np.unique(rows, return_index=True)
    return rows, probs[keep]


def study_map(y_onehot, probs):
    # competition: mAP over the 4 study classes, scaled by 2/3 in the final metric
    return float(np.mean([average_precision_score(y_onehot[:, c], probs[:, c]) for c in range(len(STUDY_CLASSES))]))


def train_fold(fold, df, args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=timedelta(minutes=30))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tr_ds = CXR(df[df.fold != fold], args.img_dir, get_tf(args.size, True))
    va_ds = CXR(df[df.fold == fold], args.img_dir, get_tf(args.size, False))
    tr_sampler = DistributedSampler(tr_ds, shuffle=True, seed=fold)
    tr_dl = DataLoader(tr_ds, args.bs, sampler=tr_sampler, num_workers=args.workers, pin_memory=True, drop_last=True)
    va_dl = DataLoader(va_ds, args.bs * 2, sampler=DistributedSampler(va_ds, shuffle=False),
                       num_workers=args.workers, pin_memory=True)

    model = timm.create_model(args.arch, pretrained=True, num_classes=len(STUDY_CLASSES), drop_path_rate=0.2)
    model = DDP(model.to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, epochs=args.epochs, steps_per_epoch=len(tr_dl),
                                                pct_start=0.1, anneal_strategy="cos")
    scaler = torch.cuda.amp.GradScaler()
    crit = nn.CrossEntropyLoss(label_smoothing=0.05)

    ckpt = os.path.join(args.out, f"study_fold{fold}.pth")
    best = -1.0
    y_va = df.loc[df.fold == fold, STUDY_CLASSES]
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for x, y, _ in tr_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = crit(model(x), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            tot += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        dist.all_reduce(tot)

        rows, probs = predict(model, va_dl, device, world_size)
        score = study_map(y_va.loc[rows].to_numpy(), probs)
        if rank == 0:
            print(f"fold {fold} ep {epoch:02d} loss {(tot[0] / tot[1]).item():.4f} mAP {score:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if score > best:
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "map": score}, ckpt)
        best = max(best, score)

    state = torch.load(ckpt, map_location=device)
    model.module.load_state_dict(state["model"])
    rows, probs = predict(model, va_dl, device, world_size, tta=True)
    oof_score = study_map(y_va.loc[rows].to_numpy(), probs)
    if rank == 0:
        print(f"fold {fold}: best epoch {state['epoch']} mAP {state['map']:.4f} -> TTA {oof_score:.4f}", flush=True)
        pd.DataFrame(probs, columns=STUDY_CLASSES, index=rows).to_csv(os.path.join(args.out, f"oof_fold{fold}.csv"))

    del model, opt
    torch.cuda.empty_cache()
    dist.destroy_process_group()
    return oof_score


def main():
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    df = pd.read_csv(args.meta).reset_index(drop=True)
    scores = [train_fold(f, df, args) for f in args.folds]
    if int(os.environ["RANK"]) == 0:
        print("OOF study mAP per fold", np.round(scores, 4), "mean", float(np.mean(scores)))
        print("study-level part of the LB metric (x 2/3):", float(np.mean(scores)) * 2 / 3)


if __name__ == "__main__":
    main()
