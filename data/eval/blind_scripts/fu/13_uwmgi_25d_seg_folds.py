"""UW-Madison GI Tract segmentation, 2.5D (5 neighbouring slices as channels), 5 folds.

The process group is rebuilt per fold. Each fold logs to its own W&B run in the
experiment group.

    torchrun --nproc_per_node=4 13_uwmgi_25d_seg_folds.py --exp unet_effb4_25d --folds 0 1 2 3 4
"""
import argparse
import os
import time

import albumentations as A
import numpy as np
import pandas as pd
import segmentation_models_pytorch as smp
import torch
import torch.distributed as dist
import torch.nn as nn
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

CLASSES = ["large_bowel", "small_bowel", "stomach"]


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--exp", default="unet_effb4_25d")
    ap.add_argument("--meta", default="data/uwmgi_25d/meta_folds.csv")
    ap.add_argument("--npy-dir", default="data/uwmgi_25d/npy")
    ap.add_argument("--folds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--encoder", default="efficientnet-b4")
    ap.add_argument("--size", type=int, default=384)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


class SliceDS(Dataset):
    def __init__(self, df, npy_dir, aug):
        self.ids = df["id"].tolist()
        self.rows = df.index.to_numpy()
        self.npy_dir = npy_dir
        self.aug = aug

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        img = np.load(os.path.join(self.npy_dir, f"{self.ids[i]}_img.npy")).astype(np.float32)  # H,W,5
        msk = np.load(os.path.join(self.npy_dir, f"{self.ids[i]}_mask.npy")).astype(np.float32)  # H,W,3
        img /= max(img.max(), 1.0)
        out = self.aug(image=img, mask=msk)
        img = torch.from_numpy(out["image"].transpose(2, 0, 1))
        msk = torch.from_numpy(out["mask"].transpose(2, 0, 1))
        return img, msk, self.rows[i]


def augs(size, train):
    if not train:
        return A.Compose([A.Resize(size, size)])
    return A.Compose([
        A.Resize(size, size),
        A.HorizontalFlip(p=0.5),
        A.ShiftScaleRotate(shift_limit=0.0625, scale_limit=0.05, rotate_limit=10, p=0.5),
        A.OneOf([A.GridDistortion(num_steps=5, distort_limit=0.05), A.ElasticTransform(alpha=1, sigma=50)], p=0.25),
        A.CoarseDropout(max_holes=8, max_height=size // 20, max_width=size // 20, p=0.5),
    ])


def dice_coef(pred, mask, eps=1e-3):
    inter = (pred * mask).sum((2, 3))
    den = pred.sum((2, 3)) + mask.sum((2, 3))
    return (2 * inter + eps) / (den + eps)  # (B, C)


def iou_coef(pred, mask, eps=1e-3):
    inter = (pred * mask).sum((2, 3))
    union = pred.sum((2, 3)) + mask.sum((2, 3)) - inter
    return (inter + eps) / (union + eps)


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    dices, ious, rows = [], [], []
    for img, msk, r in loader:
        img, msk = img.to(device), msk.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            logit = model(img)
        pred = (logit.float().sigmoid() > 0.5).float()
        dices.append(dice_coef(pred, msk))
        ious.append(iou_coef(pred, msk))
        rows.append(r.to(device))
    return torch.cat(rows), torch.cat(dices), torch.cat(ious)


def all_gather_cat(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.cat(out)


def run_fold(fold, meta, args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    run = wandb.init(project="uwmgi", group=args.exp, name=f"{args.exp}_fold{fold}", config=vars(args),
                     reinit=True)

    tr_ds = SliceDS(meta[meta.fold != fold], args.npy_dir, augs(args.size, True))
    va_ds = SliceDS(meta[meta.fold == fold], args.npy_dir, augs(args.size, False))
    tr_sampler = DistributedSampler(tr_ds, shuffle=True)
    tr_dl = DataLoader(tr_ds, args.bs, sampler=tr_sampler, num_workers=args.workers, drop_last=True, pin_memory=True)
    va_dl = DataLoader(va_ds, args.bs * 2, sampler=DistributedSampler(va_ds, shuffle=False),
                       num_workers=args.workers, pin_memory=True)

    model = smp.Unet(args.encoder, encoder_weights="imagenet", in_channels=5, classes=len(CLASSES))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-6)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(tr_dl), eta_min=1e-6)
    scaler = torch.cuda.amp.GradScaler()
    dice_loss = smp.losses.DiceLoss(mode="multilabel")
    bce_loss = smp.losses.SoftBCEWithLogitsLoss()

    best = -1.0
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for img, msk, _ in tr_dl:
            img, msk = img.to(device, non_blocking=True), msk.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logit = model(img)
                loss = 0.5 * bce_loss(logit, msk) + 0.5 * dice_loss(logit, msk)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            running += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        dist.all_reduce(running)

        rows, dices, ious = validate(model, va_dl, device)
        rows, dices, ious = all_gather_cat(rows), all_gather_cat(dices), all_gather_cat(ious)
        _, keep = np.unique(rows.cpu().numpy(), return_index=True)
        keep = torch.as_tensor(keep, device=device)
        dice, iou = dices[keep].mean().item(), ious[keep].mean().item()
        score = 0.4 * dice + 0.6 * iou  # proxy for the dice + 3D hausdorff competition metric

        run.log({"epoch": epoch, "train/loss": (running[0] / running[1]).item(), "val/dice": dice,
                 "val/iou": iou, "lr": sched.get_last_lr()[0]})
        if rank == 0:
            print(f"fold {fold} ep {epoch:02d} dice {dice:.4f} iou {iou:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if score > best:
                torch.save(model.module.state_dict(), os.path.join(args.exp, f"best_fold{fold}.pt"))
                run.summary["best_dice"] = dice
        best = max(best, score)

    run.finish()
    dist.barrier()
    dist.destroy_process_group()
    return best


def main():
    args = parse_args()
    os.makedirs(args.exp, exist_ok=True)
    meta = pd.read_csv(args.meta).reset_index(drop=True)  # fold column: StratifiedGroupKFold by case
    scores = {}
    for fold in args.folds:
        scores[fold] = run_fold(fold, meta, args)
        torch.cuda.empty_cache()
    if int(os.environ.get("RANK", "0")) == 0:
        print("fold scores:", scores, "mean:", float(np.mean(list(scores.values()))))


if __name__ == "__main__":
    main()
