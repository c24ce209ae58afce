# k-fold image classification, timm backbone + EMA, DDP via torchrun
# torchrun --nproc_per_node=4 03_kfold_timm_ema.py --fold 0 --model tf_efficientnet_b3_ns
import argparse
import os
import time
import random

import cv2
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from sklearn.metrics import roc_auc_score
import albumentations as A
from albumentations.pytorch import ToTensorV2
import timm
from timm.utils import ModelEmaV2


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", default="../input/train_images")
    p.add_argument("--csv", default="../input/train_folds.csv")
    p.add_argument("--out_dir", default="./outputs")
    p.add_argument("--model", default="tf_efficientnet_b3_ns")
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--img_size", type=int, default=512)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--wd", type=float, default=1e-2)
    p.add_argument("--ema_decay", type=float, default=0.9997)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def seed_everything(seed):
    random.seed(seed)
    os.environ["PYTHONHASHSEED"] = str(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def get_transforms(img_size, train=True):
    if train:
        return A.Compose([
            A.RandomResizedCrop(img_size, img_size, scale=(0.7, 1.0)),
            A.HorizontalFlip(p=0.5),
            A.VerticalFlip(p=0.5),
            A.ShiftScaleRotate(p=0.3),
            A.HueSaturationValue(p=0.3),
            A.CoarseDropout(max_holes=8, p=0.3),
            A.Normalize(),
            ToTensorV2(),
        ])
    return A.Compose([A.Resize(img_size, img_size), A.Normalize(), ToTensorV2()])


class ImgDataset(Dataset):
    def __init__(self, df, data_dir, transforms):
        self.paths = [os.path.join(data_dir, f"{i}.jpg") for i in df.image_id.values]
        self.targets = df.target.values.astype(np.float32)
        self.idx = df.index.values
        self.tf = transforms

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = cv2.imread(self.paths[i])
        img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
        img = self.tf(image=img)["image"]
        return img, torch.tensor(self.targets[i]), self.idx[i]


def gather_predictions(preds, targets, idxs):
    payload = (preds, targets, idxs)
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, payload)
    p = np.concatenate([o[0] for o in out])
    t = np.concatenate([o[1] for o in out])
    ix = np.concatenate([o[2] for o in out])
    # DistributedSampler pads the last shard with repeats -> drop duplicates
    _, uniq = np.unique(ix, return_index=True)
    return p[uniq], t[uniq], ix[uniq]


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    preds, targets, idxs = [], [], []
    for imgs, y, ix in loader:
        imgs = imgs.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():
            logits = model(imgs).squeeze(1)
        preds.append(logits.sigmoid().float().cpu().numpy())
        targets.append(y.numpy())
        idxs.append(ix.numpy())
    return np.concatenate(preds), np.concatenate(targets), np.concatenate(idxs)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    seed_everything(args.seed + rank)
    is_main = rank == 0

    if is_main:
        os.makedirs(args.out_dir, exist_ok=True)

    df = pd.read_csv(args.csv)
    trn_df = df[df.fold != args.fold]
    val_df = df[df.fold == args.fold]

    trn_ds = ImgDataset(trn_df, args.data_dir, get_transforms(args.img_size, True))
    val_ds = ImgDataset(val_df, args.data_dir, get_transforms(args.img_size, False))
    trn_sampler = DistributedSampler(trn_ds, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    trn_dl = DataLoader(trn_ds, batch_size=args.batch_size, sampler=trn_sampler,
                        num_workers=args.workers, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size * 2, sampler=val_sampler,
                        num_workers=args.workers, pin_memory=True)

    model = timm.create_model(args.model, pretrained=True, num_classes=1, drop_path_rate=0.2)
    model.to(device)
    ema = ModelEmaV2(model, decay=args.ema_decay)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wd)
    steps_per_epoch = len(trn_dl) // args.accum
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.lr, total_steps=args.epochs * steps_per_epoch + 1, pct_start=0.1)
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.BCEWithLogitsLoss()

    log_path = os.path.join(args.out_dir, f"log_fold{args.fold}.csv")
    best_auc = -1.0
    for epoch in range(args.epochs):
        trn_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        optimizer.zero_grad(set_to_none=True)
        for step, (imgs, y, _) in enumerate(trn_dl):
            imgs = imgs.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            do_step = (step + 1) % args.accum == 0
            ctx = model.no_sync() if not do_step else torch.enable_grad()
            with ctx:
                with torch.cuda.amp.autocast():
                    logits = model(imgs).squeeze(1)
                    loss = criterion(logits, y) / args.accum
                scaler.scale(loss).backward()
            if do_step:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                ema.update(model.module)
            running[0] += loss.detach() * args.accum * imgs.size(0)
            running[1] += imgs.size(0)

        dist.all_reduce(running, op=dist.ReduceOp.SUM)
        train_loss = (running[0] / running[1]).item()

        p, t, ix = validate(ema.module, val_dl, device)
        p, t, ix = gather_predictions(p, t, ix)
        auc = roc_auc_score(t, p)

        if is_main:
            print(f"fold {args.fold} ep {epoch} loss {train_loss:.4f} auc {auc:.4f} "
                  f"lr {scheduler.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)
            row = pd.DataFrame([{"epoch": epoch, "train_loss": train_loss, "val_auc": auc}])
            row.to_csv(log_path, mode="a", header=not os.path.exists(log_path), index=False)
            if auc > best_auc:
                best_auc = auc
                torch.save(ema.module.state_dict(),
                           os.path.join(args.out_dir, f"{args.model}_fold{args.fold}_best.pth"))
                oof = val_df.loc[ix].copy()
                oof["pred"] = p
                oof.to_csv(os.path.join(args.out_dir, f"oof_fold{args.fold}.csv"), index=False)
        dist.barrier()

    if is_main:
        print(f"fold {args.fold} best auc {best_auc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
