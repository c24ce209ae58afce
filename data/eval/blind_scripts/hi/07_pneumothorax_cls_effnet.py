"""SIIM-ACR pneumothorax: image-level classifier (EfficientNet-B3, timm), 5-fold CV.

torchrun --nproc_per_node=4 07_pneumothorax_cls_effnet.py --fold 0 --data /data/siim --out work/ptx_b3
"""
import argparse
import logging
import os

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
from torch.cuda.amp import GradScaler, autocast
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("ptx")


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="folder with train_png/ and folds.csv")
    p.add_argument("--out", default="work/ptx_b3")
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--arch", default="tf_efficientnet_b3.ns_jft_in1k")
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--bs", type=int, default=12)
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


class PTXDataset(Dataset):
    def __init__(self, df, img_dir, tf):
        self.ids = df["ImageId"].values
        self.y = df["has_pneumothorax"].values.astype(np.float32)
        self.img_dir = img_dir
        self.tf = tf

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        img = cv2.imread(os.path.join(self.img_dir, f"{self.ids[i]}.png"), cv2.IMREAD_COLOR)
        img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
        img = self.tf(image=img)["image"]
        return img, torch.tensor(self.y[i])


def transforms(size, train):
    if train:
        return A.Compose([
            A.RandomResizedCrop(size, size, scale=(0.75, 1.0)),
            A.HorizontalFlip(p=0.5),
            A.ShiftScaleRotate(shift_limit=0.05, scale_limit=0.05, rotate_limit=10, p=0.5),
            A.RandomBrightnessContrast(p=0.5),
            A.CLAHE(p=0.2),
            A.Normalize(),
            ToTensorV2(),
        ])
    return A.Compose([A.Resize(size, size), A.Normalize(), ToTensorV2()])


def run_validation(model, loader, device):
    model.eval()
    probs, targets, losses = [], [], []
    crit = nn.BCEWithLogitsLoss(reduction="none")
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            with autocast():
                logit = model(x).squeeze(1)
            losses.append(crit(logit.float(), y).cpu())
            probs.append(torch.sigmoid(logit.float()).cpu())
            targets.append(y.cpu())
    probs = torch.cat(probs).numpy()
    targets = torch.cat(targets).numpy()
    val_loss = torch.cat(losses).mean().item()
    auc = roc_auc_score(targets, probs)
    return val_loss, auc


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s | %(message)s")

    folds = pd.read_csv(os.path.join(args.data, "folds.csv"))
    train_df = folds[folds.fold != args.fold].reset_index(drop=True)
    valid_df = folds[folds.fold == args.fold].reset_index(drop=True)
    img_dir = os.path.join(args.data, "train_png")
    train_ds = PTXDataset(train_df, img_dir, transforms(args.size, True))
    valid_ds = PTXDataset(valid_df, img_dir, transforms(args.size, False))

    train_sampler = DistributedSampler(train_ds, shuffle=True)
    valid_sampler = DistributedSampler(valid_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_ds, batch_size=args.bs * 2, sampler=valid_sampler,
                              num_workers=args.workers, pin_memory=True)

    model = timm.create_model(args.arch, pretrained=True, num_classes=1, drop_rate=0.3, drop_path_rate=0.2)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    pos_frac = train_df["has_pneumothorax"].mean()
    criterion = nn.BCEWithLogitsLoss(pos_weight=torch.tensor((1 - pos_frac) / pos_frac, device=device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, epochs=args.epochs,
                                                    steps_per_epoch=len(train_loader), pct_start=0.1)
    scaler = GradScaler()

    out_dir = os.path.join(args.out, f"fold{args.fold}")
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
    best_auc = 0.0

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for it, (x, y) in enumerate(train_loader):
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            with autocast():
                loss = criterion(model(x).squeeze(1), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if it % 100 == 0:
                log.info("ep %02d it %04d/%d loss %.4f", epoch, it, len(train_loader), loss.item())

        val_loss, val_auc = run_validation(model, valid_loader, device)
        if rank == 0:
            log.info("ep %02d fold %d val_loss %.4f val_auc %.4f", epoch, args.fold, val_loss, val_auc)
            if val_auc > best_auc:
                best_auc = val_auc
                torch.save(model.module.state_dict(), os.path.join(out_dir, "best_auc.pth"))
                log.info("  saved best (auc %.4f)", best_auc)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch},
                       os.path.join(out_dir, "last.pth"))
        dist.barrier()

    if rank == 0:
        with open(os.path.join(out_dir, "result.txt"), "w") as f:
            f.write(f"fold {args.fold} best_auc {best_auc:.5f}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
