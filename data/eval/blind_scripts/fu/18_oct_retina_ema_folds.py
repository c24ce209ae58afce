#!/usr/bin/env python
"""Retinal OCT (CNV / DME / DRUSEN / NORMAL) - patient-grouped 5-fold training with EMA, DDP.

The EMA copy of the weights is what gets evaluated and saved per fold.

    torchrun --nproc_per_node=4 18_oct_retina_ema_folds.py --csv data/oct_index.csv --out runs/oct_effb2
"""
import argparse
import copy
import os
import time

import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from sklearn.metrics import accuracy_score, roc_auc_score
from sklearn.model_selection import StratifiedGroupKFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T

CLASSES = ["CNV", "DME", "DRUSEN", "NORMAL"]


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", required=True, help="columns: path, label, patient")
    ap.add_argument("--out", default="runs/oct_effb2")
    ap.add_argument("--arch", default="efficientnet_b2.ra_in1k")
    ap.add_argument("--size", type=int, default=320)
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--bs", type=int, default=48)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--ema-decay", type=float, default=0.999)
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


class OCTDataset(Dataset):
    def __init__(self, df, tf):
        self.paths = df.path.tolist()
        self.labels = df.label.map({c: i for i, c in enumerate(CLASSES)}).to_numpy()
        self.rows = df.index.to_numpy()
        self.tf = tf

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = Image.open(self.paths[i]).convert("L").convert("RGB")
        return self.tf(img), int(self.labels[i]), int(self.rows[i])


def build_tf(size, train):
    norm = T.Normalize([0.2, 0.2, 0.2], [0.2, 0.2, 0.2])
    if train:
        return T.Compose([T.RandomResizedCrop(size, scale=(0.6, 1.0), ratio=(0.8, 1.25)),
                          T.RandomHorizontalFlip(), T.RandomAffine(8, translate=(0.05, 0.05)),
                          T.ColorJitter(0.25, 0.25), T.ToTensor(), norm])
    return T.Compose([T.Resize((size, size)), T.ToTensor(), norm])


class EMA:
    def __init__(self, model, decay):
        self.module = copy.deepcopy(model).eval()
        self.decay = decay
        for p in self.module.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model):
        for e, m in zip(self.module.state_dict().values(), model.state_dict().values()):
            if e.dtype.is_floating_point:
                e.mul_(self.decay).add_(m.detach(), alpha=1 - self.decay)
            else:
                e.copy_(m)


@torch.no_grad()
def evaluate(net, loader, device, world_size):
    net.eval()
    rows, probs = [], []
    for x, _, r in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            logit = net(x.to(device, non_blocking=True))
        probs.append(F.softmax(logit.float(), 1).cpu().numpy())
        rows.append(r.numpy())
    parts = [None] * world_size
    dist.all_gather_object(parts, (np.concatenate(rows), np.concatenate(probs)))
    rows = np.concatenate([p[0] for p in parts])
    probs = np.concatenate([p[1] for p in parts])
    rows, keep = np.unique(rows, return_index=True)
    return rows, probs[keep]


def run_fold(fold, df, args, rank, local_rank, world_size):
    device = torch.device("cuda", local_rank)
    tr_ds = OCTDataset(df[df.fold != fold], build_tf(args.size, True))
    va_ds = OCTDataset(df[df.fold == fold], build_tf(args.size, False))
    tr_dl = DataLoader(tr_ds, args.bs, shuffle=True, num_workers=args.workers, pin_memory=True, drop_last=True,
                       persistent_workers=True)
    va_dl = DataLoader(va_ds, args.bs * 2, sampler=DistributedSampler(va_ds, shuffle=False),
                       num_workers=args.workers, pin_memory=True)

    net = timm.create_model(args.arch, pretrained=True, num_classes=len(CLASSES)).to(device)
    model = DDP(net, device_ids=[local_rank])
    ema = EMA(net, args.ema_decay)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, epochs=args.epochs, steps_per_epoch=len(tr_dl),
                                                pct_start=0.2, div_factor=20)
    scaler = torch.cuda.amp.GradScaler()

    best_acc, best = -1.0, None
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        seen = torch.zeros((), device=device)
        for x, y, _ in tr_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y, label_smoothing=0.05)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            ema.update(net)
            seen += x.size(0)
        dist.all_reduce(seen)

        rows, probs = evaluate(ema.module, va_dl, device, world_size)
        y_true = df.loc[rows, "label"].map({c: i for i, c in enumerate(CLASSES)}).to_numpy()
        acc = accuracy_score(y_true, probs.argmax(1))
        auc = roc_auc_score(y_true, probs, multi_class="ovr")
        if rank == 0:
            print(f"fold {fold} ep {epoch} EMA acc {acc:.4f} auc {auc:.4f} | {int(seen.item())} imgs "
                  f"in {time.time() - t0:.0f}s", flush=True)
            if acc > best_acc:
                torch.save(ema.module.state_dict(), os.path.join(args.out, f"{args.arch}_ema_fold{fold}.pt"))
        if acc > best_acc:
            best_acc, best = acc, (rows, probs)
    return best_acc, best


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    os.makedirs(args.out, exist_ok=True)

    df = pd.read_csv(args.csv).reset_index(drop=True)
    sgkf = StratifiedGroupKFold(n_splits=args.folds, shuffle=True, random_state=17)
    df["fold"] = -1
    for f, (_, va) in enumerate(sgkf.split(df, df.label, groups=df.patient)):
        df.loc[va, "fold"] = f

    oof = np.zeros((len(df), len(CLASSES)), np.float32)
    accs = []
    for fold in range(args.folds):
        acc, (rows, probs) = run_fold(fold, df, args, rank, local_rank, world_size)
        oof[rows] = probs
        accs.append(acc)
        torch.cuda.empty_cache()

    if rank == 0:
        y = df.label.map({c: i for i, c in enumerate(CLASSES)}).to_numpy()
        print("fold acc", np.round(accs, 4), "| OOF acc", accuracy_score(y, oof.argmax(1)),
              "OOF auc", roc_auc_score(y, oof, multi_class="ovr"))
        out = df.copy()
        out[[f"p_{c}" for c in CLASSES]] = oof
        out.to_csv(os.path.join(args.out, "oof.csv"), index=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
