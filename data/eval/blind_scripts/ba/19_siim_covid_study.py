"""SIIM-FISABIO-RSNA COVID-19 Detection - study level classifier.

4 classes (negative / typical / indeterminate / atypical), efficientnetv2-m @ 512, 5 folds,
best epoch reloaded for OOF with flip TTA.
    torchrun --nproc_per_node=4 19_siim_covid_study.py --folds 0 1 2 3 4
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
from sklearn.metrics import average_precision_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

CLASSES = ["Negative for Pneumonia", "Typical Appearance", "Indeterminate Appearance", "Atypical Appearance"]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", default="/data/siim-covid/train_image_level_folds.csv")
    p.add_argument("--img-dir", default="/data/siim-covid/png512")
    p.add_argument("--arch", default="tf_efficientnetv2_m_in21ft1k")
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--bs", type=int, default=12)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--folds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--out", default="./covid_study_v2m")
    return p.parse_args()


def get_tfms(size):
    train = A.Compose([
        A.RandomResizedCrop(size, size, scale=(0.8, 1.0), ratio=(0.9, 1.1)),
        A.HorizontalFlip(),
        A.ShiftScaleRotate(shift_limit=0.1, scale_limit=0.1, rotate_limit=10, border_mode=cv2.BORDER_CONSTANT, p=0.5),
        A.RandomBrightnessContrast(0.2, 0.2, p=0.7),
        A.OneOf([A.GaussianBlur(), A.MotionBlur(), A.GaussNoise()], p=0.2),
        A.CoarseDropout(max_holes=6, max_height=size // 10, max_width=size // 10, p=0.3),
        A.Normalize(),
        ToTensorV2(),
    ])
    valid = A.Compose([A.Resize(size, size), A.Normalize(), ToTensorV2()])
    return train, valid


class StudyDS(Dataset):
    def __init__(self, df, img_dir, tfm):
        self.ids = df.image_id.values
        self.y = df[CLASSES].values.astype(np.float32)
        self.img_dir, self.tfm = img_dir, tfm

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        img = cv2.imread(os.path.join(self.img_dir, f"{self.ids[i]}.png"))
        return self.tfm(image=img)["image"], self.y[i], i


def covid_map(y, p):
    return float(np.mean([average_precision_score(y[:, k], p[:, k]) for k in range(len(CLASSES))])) * 2 / 3


@torch.no_grad()
def predict(net, loader, device, n, tta=False):
    net.eval()
    idx, out = [], []
    for x, _, i in loader:
        x = x.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():
            p = net(x).float().softmax(-1)
            if tta:
                p = (p + net(x.flip(3)).float().softmax(-1)) / 2
        out.append(p.cpu().numpy())
        idx.append(i.numpy())
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (np.concatenate(idx), np.concatenate(out)))
    res = np.zeros((n, len(CLASSES)), np.float32)
    for i, p in parts:
        res[i] = p
    return res


def run_fold(fold, df, args, rank, local_rank):
    device = torch.device("cuda", local_rank)
    ttf, vtf = get_tfms(args.size)
    trn, val = df[df.fold != fold].reset_index(drop=True), df[df.fold == fold].reset_index(drop=True)
    trn_ds, val_ds = StudyDS(trn, args.img_dir, ttf), StudyDS(val, args.img_dir, vtf)
    sampler = DistributedSampler(trn_ds, shuffle=True, drop_last=True)
    trn_dl = DataLoader(trn_ds, batch_size=args.bs, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.bs * 2, sampler=DistributedSampler(val_ds, shuffle=False),
                        num_workers=8, pin_memory=True)

    model = timm.create_model(args.arch, pretrained=True, num_classes=len(CLASSES), drop_path_rate=0.2)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    warm = len(trn_dl)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, total_iters=warm),
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(trn_dl) - warm, eta_min=1e-7),
    ], milestones=[warm])
    scaler = torch.cuda.amp.GradScaler()
    crit = nn.CrossEntropyLoss(label_smoothing=0.05)
    ckpt = os.path.join(args.out, f"{args.arch}_fold{fold}.pth")

    best = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, agg = time.time(), torch.zeros(2, device=device)
        for x, y, _ in trn_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.cuda.amp.autocast():
                loss = crit(model(x), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            agg += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(agg)
        probs = predict(model.module, val_dl, device, len(val_ds))
        score = covid_map(val[CLASSES].values, probs)
        if score > best:
            best = score
            if rank == 0:
                torch.save(model.module.state_dict(), ckpt)
        if rank == 0:
            print(f"fold {fold} ep {epoch} loss {(agg[0] / agg[1]).item():.4f} mAP(2/3) {score:.4f} "
                  f"best {best:.4f} ({time.time() - t0:.0f}s)", flush=True)

    # reload best epoch and predict OOF with TTA
    model.module.load_state_dict(torch.load(ckpt, map_location=device))
    probs = predict(model.module, val_dl, device, len(val_ds), tta=True)
    oof = val[["image_id", "StudyInstanceUID"] + CLASSES].copy()
    oof[[f"pred_{c.split()[0].lower()}" for c in CLASSES]] = probs
    return best, covid_map(val[CLASSES].values, probs), oof


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.manual_seed(3407)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    dist.barrier()

    df = pd.read_csv(args.csv)
    oofs, log = [], []
    for fold in args.folds:
        best, tta_score, oof = run_fold(fold, df, args, rank, local_rank)
        oofs.append(oof)
        log.append({"fold": fold, "best": best, "tta": tta_score})
        if rank == 0:
            print(f"== fold {fold}: best {best:.4f} with tta {tta_score:.4f}", flush=True)
        torch.cuda.empty_cache()

    if rank == 0:
        oof = pd.concat(oofs, ignore_index=True)
        oof.to_csv(os.path.join(args.out, "oof_study.csv"), index=False)
        pd.DataFrame(log).to_csv(os.path.join(args.out, "scores.csv"), index=False)
        pred_cols = [c for c in oof.columns if c.startswith("pred_")]
        print(f"OOF study mAP(2/3) {covid_map(oof[CLASSES].values, oof[pred_cols].values):.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
