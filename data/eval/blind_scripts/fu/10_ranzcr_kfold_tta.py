"""RANZCR CLiP catheter/line position: 5-fold training + distributed TTA ensemble on the test set.

    torchrun --nproc_per_node=4 10_ranzcr_kfold_tta.py --data /data/ranzcr --workdir exp/ranzcr_b5
"""
import argparse
import os
import time

import albumentations as A
import cv2
import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from albumentations.pytorch import ToTensorV2
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import GroupKFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

TARGETS = ["ETT - Abnormal", "ETT - Borderline", "ETT - Normal", "NGT - Abnormal", "NGT - Borderline",
           "NGT - Incompletely Imaged", "NGT - Normal", "CVC - Abnormal", "CVC - Borderline", "CVC - Normal",
           "Swan Ganz Catheter Present"]

# inference helpers (shared with the Kaggle notebook)
DEVICE = torch.device("cuda:0")
TTA_FLIPS = [None, "hflip"]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--workdir", default="exp/ranzcr")
    p.add_argument("--arch", default="tf_efficientnet_b5_ns")
    p.add_argument("--size", type=int, default=640)
    p.add_argument("--folds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--bs", type=int, default=10)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


class XrayDS(Dataset):
    def __init__(self, paths, labels, tf):
        self.paths, self.labels, self.tf = paths, labels, tf

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = cv2.imread(self.paths[i], cv2.IMREAD_GRAYSCALE)
        img = cv2.cvtColor(img, cv2.COLOR_GRAY2RGB)
        img = self.tf(image=img)["image"]
        return img, torch.from_numpy(self.labels[i]), i


def get_tf(size, train):
    if train:
        return A.Compose([
            A.RandomResizedCrop(size, size, scale=(0.85, 1.0)),
            A.HorizontalFlip(p=0.5),
            A.RandomBrightnessContrast(0.2, 0.2, p=0.75),
            A.ShiftScaleRotate(0.1, 0.1, 15, border_mode=0, p=0.5),
            A.CoarseDropout(max_holes=8, max_height=32, max_width=32, p=0.3),
            A.Normalize(), ToTensorV2(),
        ])
    return A.Compose([A.Resize(size, size), A.Normalize(), ToTensorV2()])


def gather(idx, probs, world_size):
    parts = [None] * world_size
    dist.all_gather_object(parts, (idx, probs))
    idx = np.concatenate([p[0] for p in parts])
    probs = np.concatenate([p[1] for p in parts])
    idx, keep = np.unique(idx, return_index=True)
    return idx, probs[keep]


def mean_auc(y, p):
    return float(np.mean([roc_auc_score(y[:, i], p[:, i]) for i in range(y.shape[1]) if 0 < y[:, i].sum() < len(y)]))


def train_fold(fold, df, args, rank, local_rank, world_size):
    device = torch.device("cuda", local_rank)
    tr, va = df[df.fold != fold].reset_index(drop=True), df[df.fold == fold].reset_index(drop=True)
    tr_ds = XrayDS(tr.path.tolist(), tr[TARGETS].to_numpy(np.float32), get_tf(args.size, True))
    va_ds = XrayDS(va.path.tolist(), va[TARGETS].to_numpy(np.float32), get_tf(args.size, False))
    tr_sampler = DistributedSampler(tr_ds, shuffle=True)
    tr_dl = DataLoader(tr_ds, args.bs, sampler=tr_sampler, num_workers=args.workers, pin_memory=True, drop_last=True)
    va_dl = DataLoader(va_ds, args.bs * 2, sampler=DistributedSampler(va_ds, shuffle=False),
                       num_workers=args.workers, pin_memory=True)

    model = timm.create_model(args.arch, pretrained=True, num_classes=len(TARGETS)).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs, eta_min=1e-6)
    scaler = torch.cuda.amp.GradScaler()
    crit = nn.BCEWithLogitsLoss()

    best = 0.0
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y, _ in tr_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.cuda.amp.autocast():
                loss = crit(model(x), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        sched.step()

        model.eval()
        idx_l, p_l = [], []
        with torch.no_grad(), torch.cuda.amp.autocast():
            for x, _, i in va_dl:
                p_l.append(model(x.to(device)).sigmoid().float().cpu().numpy())
                idx_l.append(i.numpy())
        idx, probs = gather(np.concatenate(idx_l), np.concatenate(p_l), world_size)
        auc = mean_auc(va[TARGETS].to_numpy()[idx], probs)
        if rank == 0:
            print(f"fold {fold} ep {epoch} AUC {auc:.4f} {time.time() - t0:.0f}s", flush=True)
            if auc > best:
                torch.save(model.module.state_dict(), os.path.join(args.workdir, f"fold{fold}.pth"))
        best = max(best, auc)
    return best


def load_fold_model(arch, path):
    model = timm.create_model(arch, pretrained=False, num_classes=len(TARGETS))
    model.load_state_dict(torch.load(path, map_location="cpu"))
    return model.to(DEVICE).eval()


@torch.no_grad()
def predict_tta(model, loader):
    idx_l, p_l = [], []
    for x, _, i in loader:
        x = x.to(DEVICE)
        p = 0
        for flip in TTA_FLIPS:
            xi = torch.flip(x, dims=[3]) if flip == "hflip" else x
            with torch.cuda.amp.autocast():
                p = p + model(xi).sigmoid().float()
        p_l.append((p / len(TTA_FLIPS)).cpu().numpy())
        idx_l.append(i.numpy())
    return np.concatenate(idx_l), np.concatenate(p_l)


def ensemble_test(args, world_size):
    sub = pd.read_csv(os.path.join(args.data, "sample_submission.csv"))
    paths = [os.path.join(args.data, "test", f"{u}.jpg") for u in sub.StudyInstanceUID]
    ds = XrayDS(paths, np.zeros((len(sub), len(TARGETS)), np.float32), get_tf(args.size, False))
    dl = DataLoader(ds, args.bs * 2, sampler=DistributedSampler(ds, shuffle=False), num_workers=args.workers)
    total = None
    for fold in range(args.folds):
        model = load_fold_model(args.arch, os.path.join(args.workdir, f"fold{fold}.pth"))
        idx, probs = predict_tta(model, dl)
        total = probs if total is None else total + probs
        del model
    idx, probs = gather(idx, total / args.folds, world_size)
    sub.loc[idx, TARGETS] = probs
    return sub


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    os.makedirs(args.workdir, exist_ok=True)

    df = pd.read_csv(os.path.join(args.data, "train.csv"))
    df["path"] = args.data + "/train/" + df.StudyInstanceUID + ".jpg"
    df["fold"] = -1
    for f, (_, va) in enumerate(GroupKFold(args.folds).split(df, groups=df.PatientID)):
        df.loc[va, "fold"] = f

    scores = [train_fold(f, df, args, rank, local_rank, world_size) for f in range(args.folds)]
    if rank == 0:
        print("fold AUCs", np.round(scores, 4), "mean", np.mean(scores))
    dist.barrier()

    sub = ensemble_test(args, world_size)
    if rank == 0:
        sub.to_csv(os.path.join(args.workdir, "submission.csv"), index=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
