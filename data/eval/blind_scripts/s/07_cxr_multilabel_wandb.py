#!/usr/bin/env python3
# CXR 14-finding multilabel, convnext + AMP, W&B tracking
# torchrun --standalone --nproc_per_node=4 07_cxr_multilabel_wandb.py --fold 3 --run_name cnx_b_f3
import os
import argparse
import time

import numpy as np
import pandas as pd
import cv2
import torch
import torch.nn as nn
import torch.distributed as dist
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
import albumentations as A
from albumentations.pytorch import ToTensorV2
from sklearn.metrics import roc_auc_score
import timm
import wandb

FINDINGS = ["Atelectasis", "Cardiomegaly", "Effusion", "Infiltration", "Mass", "Nodule",
            "Pneumonia", "Pneumothorax", "Consolidation", "Edema", "Emphysema", "Fibrosis",
            "Pleural_Thickening", "Hernia"]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", default="/datasets/cxr14/folds.csv")
    p.add_argument("--img_root", default="/datasets/cxr14/images_640")
    p.add_argument("--arch", default="convnext_base.fb_in22k")
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--log_every", type=int, default=25)
    p.add_argument("--run_name", default=None)
    p.add_argument("--project", default="cxr14")
    p.add_argument("--out", default="./checkpoints")
    return p.parse_args()


def build_tf(size, train):
    if train:
        t = [A.RandomResizedCrop(size, size, scale=(0.8, 1.0), ratio=(0.9, 1.1)),
             A.ShiftScaleRotate(rotate_limit=10, p=0.5),
             A.RandomBrightnessContrast(0.15, 0.15, p=0.5),
             A.CLAHE(p=0.2)]
    else:
        t = [A.Resize(size, size)]
    return A.Compose(t + [A.Normalize(mean=0.5, std=0.25), ToTensorV2()])


class CXRDataset(Dataset):
    def __init__(self, df, root, tf):
        self.files = df["Image Index"].values
        self.lbl = df[FINDINGS].values.astype(np.float32)
        self.root = root
        self.tf = tf

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        im = cv2.imread(os.path.join(self.root, self.files[i]), cv2.IMREAD_GRAYSCALE)
        im = cv2.cvtColor(im, cv2.COLOR_GRAY2RGB)
        return self.tf(image=im)["image"], self.lbl[i], i


def train_one_epoch(model, dl, opt, sched, scaler, crit, device, epoch, args, gstep):
    model.train()
    for i, (x, y, _) in enumerate(dl):
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():
            loss = crit(model(x), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        gstep += 1
        if gstep % args.log_every == 0:
            wandb.log({"train/loss": loss.item(), "train/lr": opt.param_groups[0]["lr"],
                       "train/scale": scaler.get_scale(), "epoch": epoch}, step=gstep)
    return gstep


@torch.no_grad()
def predict(model, dl, device):
    model.eval()
    P, I = [], []
    for x, _, i in dl:
        with torch.cuda.amp.autocast():
            P.append(torch.sigmoid(model(x.to(device, non_blocking=True))).float().cpu())
        I.append(i)
    return torch.cat(P).numpy(), torch.cat(I).numpy()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        wandb.init(project=args.project, name=args.run_name, config=vars(args),
                   tags=[args.arch, f"fold{args.fold}"])

    df = pd.read_csv(args.csv)
    dtr = CXRDataset(df[df.fold != args.fold], args.img_root, build_tf(args.size, True))
    va_df = df[df.fold == args.fold].reset_index(drop=True)
    dva = CXRDataset(va_df, args.img_root, build_tf(args.size, False))
    str_ = DistributedSampler(dtr, shuffle=True)
    sva = DistributedSampler(dva, shuffle=False)
    dl_tr = DataLoader(dtr, batch_size=args.batch, sampler=str_, num_workers=args.workers,
                       pin_memory=True, drop_last=True)
    dl_va = DataLoader(dva, batch_size=args.batch, sampler=sva, num_workers=args.workers,
                       pin_memory=True)

    model = timm.create_model(args.arch, pretrained=True, num_classes=len(FINDINGS),
                              drop_path_rate=0.1).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr,
                                                total_steps=args.epochs * len(dl_tr),
                                                pct_start=0.1, anneal_strategy="cos")
    scaler = torch.cuda.amp.GradScaler()
    crit = nn.BCEWithLogitsLoss()

    os.makedirs(args.out, exist_ok=True)
    gstep, best = 0, 0.0
    for epoch in range(args.epochs):
        str_.set_epoch(epoch)
        t0 = time.time()
        gstep = train_one_epoch(model, dl_tr, opt, sched, scaler, crit, device, epoch, args, gstep)
        p, i = predict(model, dl_va, device)
        parts = [None] * world
        dist.all_gather_object(parts, (p, i))
        if rank == 0:
            P = np.concatenate([x[0] for x in parts])
            I = np.concatenate([x[1] for x in parts])
            I, k = np.unique(I, return_index=True)
            P = P[k]
            Y = va_df.loc[I, FINDINGS].values
            aucs = [roc_auc_score(Y[:, c], P[:, c]) for c in range(len(FINDINGS))]
            mauc = float(np.mean(aucs))
            wandb.log({"val/mAUC": mauc, **{f"val/auc_{n}": a for n, a in zip(FINDINGS, aucs)}},
                      step=gstep)
            print(f"epoch {epoch} mAUC {mauc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if mauc > best:
                best = mauc
                torch.save(model.module.state_dict(), f"{args.out}/{args.arch}_f{args.fold}.pth")
                wandb.run.summary["best_mAUC"] = best
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
