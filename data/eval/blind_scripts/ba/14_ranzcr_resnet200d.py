"""RANZCR CLiP - Catheter and Line Position Challenge.

resnet200d @ 512, 5 folds, then 5-fold x (orig + hflip) ensemble on the test images.
    torchrun --nproc_per_node=8 14_ranzcr_resnet200d.py --epochs 12
    torchrun --nproc_per_node=8 14_ranzcr_resnet200d.py --infer-only
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

TARGETS = ["ETT - Abnormal", "ETT - Borderline", "ETT - Normal", "NGT - Abnormal", "NGT - Borderline",
           "NGT - Incompletely Imaged", "NGT - Normal", "CVC - Abnormal", "CVC - Borderline", "CVC - Normal",
           "Swan Ganz Catheter Present"]


def opts():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/ranzcr-clip-catheter-line-classification")
    p.add_argument("--out", default="./ranzcr_r200d")
    p.add_argument("--arch", default="resnet200d")
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--bs", type=int, default=12)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--n-folds", type=int, default=5)
    p.add_argument("--infer-only", action="store_true")
    return p.parse_args()


def aug(size, train):
    if not train:
        return A.Compose([A.Resize(size, size), A.Normalize(), ToTensorV2()])
    return A.Compose([
        A.RandomResizedCrop(size, size, scale=(0.85, 1.0)),
        A.HorizontalFlip(p=0.5),
        A.RandomBrightnessContrast(0.2, 0.2, p=0.75),
        A.ShiftScaleRotate(shift_limit=0.1, scale_limit=0.1, rotate_limit=15, border_mode=0, p=0.75),
        A.CLAHE(clip_limit=2.0, p=0.3),
        A.Cutout(max_h_size=int(size * 0.1), max_w_size=int(size * 0.1), num_holes=5, p=0.5),
        A.Normalize(),
        ToTensorV2(),
    ])


class XrayDS(Dataset):
    def __init__(self, df, img_dir, tfm, with_labels=True):
        self.uids = df.StudyInstanceUID.values
        self.y = df[TARGETS].values.astype(np.float32) if with_labels else np.zeros((len(df), len(TARGETS)), np.float32)
        self.img_dir, self.tfm = img_dir, tfm

    def __len__(self):
        return len(self.uids)

    def __getitem__(self, i):
        img = cv2.imread(os.path.join(self.img_dir, self.uids[i] + ".jpg"))
        img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
        return self.tfm(image=img)["image"], self.y[i], i


def build(arch, pretrained):
    return timm.create_model(arch, pretrained=pretrained, num_classes=len(TARGETS))


@torch.no_grad()
def sharded_predict(model, ds, bs, device, tta=False):
    dl = DataLoader(ds, batch_size=bs, sampler=DistributedSampler(ds, shuffle=False), num_workers=6)
    model.eval()
    idx, out = [], []
    for x, _, i in dl:
        x = x.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():
            p = torch.sigmoid(model(x).float())
            if tta:
                p = (p + torch.sigmoid(model(x.flip(3)).float())) / 2
        out.append(p.cpu().numpy())
        idx.append(i.numpy())
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (np.concatenate(idx), np.concatenate(out)))
    res = np.zeros((len(ds), len(TARGETS)), np.float32)
    for i, p in parts:
        res[i] = p
    return res


def macro_auc(y, p):
    return float(np.mean([roc_auc_score(y[:, k], p[:, k]) for k in range(y.shape[1])]))


def train_fold(fold, df, args, rank, local_rank):
    device = torch.device("cuda", local_rank)
    img_dir = os.path.join(args.data, "train")
    trn, val = df[df.fold != fold].reset_index(drop=True), df[df.fold == fold].reset_index(drop=True)
    trn_ds = XrayDS(trn, img_dir, aug(args.size, True))
    val_ds = XrayDS(val, img_dir, aug(args.size, False))
    sampler = DistributedSampler(trn_ds, shuffle=True, drop_last=True)
    dl = DataLoader(trn_ds, batch_size=args.bs, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)

    model = build(args.arch, pretrained=True).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(dl), eta_min=1e-6)
    scaler = torch.cuda.amp.GradScaler()
    crit = nn.BCEWithLogitsLoss()
    path = os.path.join(args.out, f"{args.arch}_fold{fold}.pth")

    best = 0.0
    for ep in range(args.epochs):
        sampler.set_epoch(ep)
        model.train()
        t0 = time.time()
        for x, y, _ in dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.cuda.amp.autocast():
                loss = crit(model(x), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
        preds = sharded_predict(model.module, val_ds, args.bs * 2, device)
        auc = macro_auc(val[TARGETS].values, preds)
        if rank == 0:
            print(f"fold {fold} ep {ep} auc {auc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if auc > best:
                best = auc
                torch.save(model.state_dict(), path)
                val.assign(**{f"pred_{t}": preds[:, k] for k, t in enumerate(TARGETS)}).to_csv(
                    os.path.join(args.out, f"oof_fold{fold}.csv"), index=False)
        dist.barrier()
    return best


def infer_test(args, rank, local_rank):
    device = torch.device("cuda", local_rank)
    sub = pd.read_csv(os.path.join(args.data, "sample_submission.csv"))
    ds = XrayDS(sub, os.path.join(args.data, "test"), aug(args.size, False), with_labels=False)
    preds = np.zeros((len(sub), len(TARGETS)), np.float32)
    for fold in range(args.n_folds):
        model = build(args.arch, pretrained=False)
        model.load_state_dict(torch.load(os.path.join(args.out, f"{args.arch}_fold{fold}.pth"), map_location="cpu"))
        preds += sharded_predict(model.to(device), ds, args.bs * 2, device, tta=True) / args.n_folds
        del model
        torch.cuda.empty_cache()
    if rank == 0:
        sub[TARGETS] = preds
        sub.to_csv(os.path.join(args.out, "submission.csv"), index=False)
        print("submission written", sub.shape)


def main():
    args = opts()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.manual_seed(0)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    dist.barrier()

    if not args.infer_only:
        df = pd.read_csv(os.path.join(args.data, "train_folds.csv"))
        scores = [train_fold(f, df, args, rank, local_rank) for f in range(args.n_folds)]
        if rank == 0:
            oof = pd.concat([pd.read_csv(os.path.join(args.out, f"oof_fold{f}.csv")) for f in range(args.n_folds)])
            cv = macro_auc(oof[TARGETS].values, oof[[f"pred_{t}" for t in TARGETS]].values)
            print(f"fold auc {np.round(scores, 4)} CV {cv:.4f}", flush=True)
        dist.barrier()
    infer_test(args, rank, local_rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
