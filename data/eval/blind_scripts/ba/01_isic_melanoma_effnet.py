"""SIIM-ISIC Melanoma Classification - EfficientNet k-fold, multi-GPU port of my kaggle notebook.

torchrun --nproc_per_node=4 01_isic_melanoma_effnet.py --data-dir /data/isic --model tf_efficientnet_b3_ns
"""
import argparse
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
from albumentations.pytorch import ToTensorV2
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", default="/data/isic")
    p.add_argument("--out-dir", default="./outputs/effnet_b3")
    p.add_argument("--model", default="tf_efficientnet_b3_ns")
    p.add_argument("--img-size", type=int, default=384)
    p.add_argument("--folds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=32, help="per GPU")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--wd", type=float, default=1e-2)
    p.add_argument("--num-workers", type=int, default=6)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--amp", action="store_true")
    return p.parse_args()


def seed_everything(seed):
    random.seed(seed)
    os.environ["PYTHONHASHSEED"] = str(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)


def get_transforms(img_size, train):
    if train:
        return A.Compose([
            A.RandomResizedCrop(img_size, img_size, scale=(0.7, 1.0)),
            A.Transpose(p=0.5),
            A.VerticalFlip(p=0.5),
            A.HorizontalFlip(p=0.5),
            A.HueSaturationValue(10, 15, 10, p=0.5),
            A.RandomBrightnessContrast(0.2, 0.2, p=0.5),
            A.CoarseDropout(max_holes=8, max_height=img_size // 16, max_width=img_size // 16, p=0.3),
            A.Normalize(),
            ToTensorV2(),
        ])
    return A.Compose([A.Resize(img_size, img_size), A.Normalize(), ToTensorV2()])


class MelanomaDataset(Dataset):
    def __init__(self, df, img_dir, transforms):
        self.paths = [os.path.join(img_dir, f"{n}.jpg") for n in df["image_name"].values]
        self.targets = df["target"].values.astype(np.float32)
        self.transforms = transforms

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, idx):
        img = cv2.imread(self.paths[idx])
        img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
        img = self.transforms(image=img)["image"]
        return img, torch.tensor(self.targets[idx])


class MelanomaNet(nn.Module):
    def __init__(self, name, pretrained=True):
        super().__init__()
        self.backbone = timm.create_model(name, pretrained=pretrained, num_classes=0)
        self.dropout = nn.Dropout(0.3)
        self.head = nn.Linear(self.backbone.num_features, 1)

    def forward(self, x):
        return self.head(self.dropout(self.backbone(x))).squeeze(-1)


def train_one_epoch(model, loader, optimizer, scheduler, scaler, criterion, device, amp):
    model.train()
    total, n = 0.0, 0
    for images, targets in loader:
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with torch.cuda.amp.autocast(enabled=amp):
            logits = model(images)
            loss = criterion(logits, targets)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        total += loss.item() * images.size(0)
        n += images.size(0)
    stats = torch.tensor([total, n], device=device, dtype=torch.float64)
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item()


@torch.no_grad()
def validate(model, loader, criterion, device, amp):
    model.eval()
    preds, targs, losses = [], [], []
    for images, targets in loader:
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        with torch.cuda.amp.autocast(enabled=amp):
            logits = model(images)
        losses.append(criterion(logits.float(), targets).item())
        preds.append(torch.sigmoid(logits.float()).cpu().numpy())
        targs.append(targets.cpu().numpy())
    preds = np.concatenate(preds)
    targs = np.concatenate(targs)
    auc = roc_auc_score(targs, preds)
    return float(np.mean(losses)), auc


def run_fold(fold, df, args, rank, world_size, local_rank):
    device = torch.device("cuda", local_rank)
    train_df = df[df.fold != fold].reset_index(drop=True)
    valid_df = df[df.fold == fold].reset_index(drop=True)
    img_dir = os.path.join(args.data_dir, "jpeg", "train")

    train_ds = MelanomaDataset(train_df, img_dir, get_transforms(args.img_size, True))
    valid_ds = MelanomaDataset(valid_df, img_dir, get_transforms(args.img_size, False))
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    valid_sampler = DistributedSampler(valid_ds, num_replicas=world_size, rank=rank, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_ds, batch_size=args.batch_size * 2, sampler=valid_sampler,
                              num_workers=args.num_workers, pin_memory=True)

    model = MelanomaNet(args.model).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wd)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.lr, total_steps=args.epochs * len(train_loader), pct_start=0.1)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)
    criterion = nn.BCEWithLogitsLoss()

    best_auc, best_path = 0.0, os.path.join(args.out_dir, f"{args.model}_fold{fold}.pth")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        train_loss = train_one_epoch(model, train_loader, optimizer, scheduler, scaler, criterion, device, args.amp)
        val_loss, val_auc = validate(model, valid_loader, criterion, device, args.amp)
        if rank == 0:
            print(f"fold {fold} epoch {epoch} train_loss {train_loss:.4f} val_loss {val_loss:.4f} "
                  f"auc {val_auc:.4f} lr {scheduler.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)
            if val_auc > best_auc:
                best_auc = val_auc
                torch.save(model.module.state_dict(), best_path)
                print(f"  saved best auc {best_auc:.4f}", flush=True)
        dist.barrier()
    return best_auc


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    seed_everything(args.seed)
    torch.backends.cudnn.benchmark = True

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
    dist.barrier()

    # folds come from the triple-stratified csv (patient-grouped), identical on every rank
    df = pd.read_csv(os.path.join(args.data_dir, "train_folds.csv"))
    if rank == 0:
        print(f"{len(df)} images, {df.target.mean():.4f} positive rate, world_size={world_size}")

    scores = {}
    for fold in args.folds:
        scores[fold] = run_fold(fold, df, args, rank, world_size, local_rank)
        torch.cuda.empty_cache()

    if rank == 0:
        res = pd.DataFrame({"fold": list(scores.keys()), "auc": list(scores.values())})
        res.to_csv(os.path.join(args.out_dir, "cv_scores.csv"), index=False)
        print(res)
        print(f"CV AUC mean {res.auc.mean():.4f} +- {res.auc.std():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
