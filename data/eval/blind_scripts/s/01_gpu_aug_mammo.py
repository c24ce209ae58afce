# Breast screening classifier - uint8 decode on CPU workers, augment/normalise on GPU
# torchrun --nproc_per_node=4 01_gpu_aug_mammo.py --fold 0 --wandb
import os
import argparse
import time
import math

import numpy as np
import pandas as pd
import cv2
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.utils.data import Dataset, DataLoader, DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
from sklearn.metrics import roc_auc_score
import timm

try:
    import wandb
except ImportError:
    wandb = None

IMG_H, IMG_W = 1024, 512
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1).cuda() * 255.0
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1).cuda() * 255.0


def pfbeta(labels, preds, beta=1.0):
    preds = np.clip(preds, 0, 1)
    ctp = (preds * labels).sum()
    cfp = (preds * (1 - labels)).sum()
    y_true_count = labels.sum()
    c_precision = ctp / (ctp + cfp + 1e-8)
    c_recall = ctp / (y_true_count + 1e-8)
    if c_precision > 0 and c_recall > 0:
        b2 = beta * beta
        return (1 + b2) * (c_precision * c_recall) / (b2 * c_precision + c_recall)
    return 0.0


class MammoDS(Dataset):
    """returns uint8 HWC -> CHW, no normalisation (done on gpu)"""

    def __init__(self, df, img_dir):
        self.df = df.reset_index(drop=True)
        self.img_dir = img_dir

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        r = self.df.iloc[i]
        img = cv2.imread(f"{self.img_dir}/{r.patient_id}/{r.image_id}.png", cv2.IMREAD_GRAYSCALE)
        img = cv2.resize(img, (IMG_W, IMG_H), interpolation=cv2.INTER_AREA)
        img = np.repeat(img[None], 3, axis=0)
        return torch.from_numpy(img), torch.tensor(r.cancer, dtype=torch.float32), i


def gpu_augment(x, train=True):
    x = x.float()
    if train:
        flip = torch.rand(x.size(0), device=x.device) < 0.5
        x[flip] = x[flip].flip(-1)
        # random brightness/contrast per sample
        a = 1.0 + (torch.rand(x.size(0), 1, 1, 1, device=x.device) - 0.5) * 0.4
        b = (torch.rand(x.size(0), 1, 1, 1, device=x.device) - 0.5) * 40.0
        x = (x * a + b).clamp(0, 255)
    x = (x - MEAN) / STD
    return x


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default="/data/rsna/train_5fold.csv")
    ap.add_argument("--img_dir", default="/data/rsna/png_1024")
    ap.add_argument("--backbone", default="efficientnetv2_rw_s")
    ap.add_argument("--fold", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--bs", type=int, default=12)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--pos_weight", type=float, default=4.0)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--save_dir", default="ckpt")
    ap.add_argument("--wandb", action="store_true")
    return ap.parse_args()


def main():
    args = get_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    use_wb = args.wandb and wandb is not None and rank == 0
    if use_wb:
        wandb.init(project="rsna-mammo", name=f"{args.backbone}-f{args.fold}", config=vars(args))

    df = pd.read_csv(args.csv)
    tr_df, va_df = df[df.fold != args.fold], df[df.fold == args.fold]
    tr_ds, va_ds = MammoDS(tr_df, args.img_dir), MammoDS(va_df, args.img_dir)
    tr_sampler = DistributedSampler(tr_ds, shuffle=True)
    va_sampler = DistributedSampler(va_ds, shuffle=False)
    tr_dl = DataLoader(tr_ds, args.bs, sampler=tr_sampler, num_workers=args.workers,
                       pin_memory=True, drop_last=True, persistent_workers=True)
    va_dl = DataLoader(va_ds, args.bs * 2, sampler=va_sampler, num_workers=args.workers,
                       pin_memory=True)

    model = timm.create_model(args.backbone, pretrained=True, num_classes=1, drop_rate=0.3)
    model = DDP(model.to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    total = args.epochs * len(tr_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, s / 200) * 0.5 * (1 + math.cos(math.pi * s / total)))
    scaler = torch.cuda.amp.GradScaler()
    crit = nn.BCEWithLogitsLoss(pos_weight=torch.tensor([args.pos_weight], device=device))

    os.makedirs(args.save_dir, exist_ok=True)
    best = -1
    gstep = 0
    for ep in range(args.epochs):
        tr_sampler.set_epoch(ep)
        model.train()
        t0 = time.time()
        for x, y, _ in tr_dl:
            x = gpu_augment(x.to(device, non_blocking=True), train=True)
            y = y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = crit(model(x).squeeze(1), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            gstep += 1
            if use_wb and gstep % 20 == 0:
                wandb.log({"train/loss": loss.item(), "lr": sched.get_last_lr()[0]}, step=gstep)

        # ---- valid
        model.eval()
        preds, ys, ids = [], [], []
        with torch.no_grad():
            for x, y, ix in va_dl:
                x = gpu_augment(x.to(device, non_blocking=True), train=False)
                with torch.autocast("cuda", dtype=torch.float16):
                    p = model(x).squeeze(1).sigmoid()
                preds.append(p.float().cpu())
                ys.append(y)
                ids.append(ix)
        part = (torch.cat(preds).numpy(), torch.cat(ys).numpy(), torch.cat(ids).numpy())
        allp = [None] * world
        dist.all_gather_object(allp, part)
        if rank == 0:
            p = np.concatenate([a[0] for a in allp])
            y = np.concatenate([a[1] for a in allp])
            ix = np.concatenate([a[2] for a in allp])
            _, u = np.unique(ix, return_index=True)
            p, y = p[u], y[u]
            auc = roc_auc_score(y, p)
            f1 = max(pfbeta(y, (p > t).astype(float)) for t in np.linspace(0.1, 0.9, 33))
            print(f"ep {ep} auc {auc:.4f} pF1 {f1:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if use_wb:
                wandb.log({"val/auc": auc, "val/pf1": f1, "epoch": ep}, step=gstep)
            if f1 > best:
                best = f1
                torch.save(model.module.state_dict(),
                           f"{args.save_dir}/{args.backbone}_f{args.fold}.pth")
        dist.barrier()

    if use_wb:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
