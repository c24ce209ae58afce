#!/usr/bin/env python
"""Brain tumour MRI (glioma / meningioma / pituitary / no tumour) - k-fold ConvNeXt + ensemble.

Stage 1 trains every fold with DDP and keeps the best checkpoint per fold.
Stage 2 loads all fold checkpoints on every rank and scores the hold-out test set
with flip TTA; each rank handles a shard of the test images.

    torchrun --nproc_per_node=4 15_brain_mri_fold_ensemble.py --root /data/brain_mri --out runs/cnx_s
"""
import argparse
import json
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
from sklearn.metrics import accuracy_score, f1_score
from sklearn.model_selection import StratifiedKFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T

CLASSES = ["glioma", "meningioma", "notumor", "pituitary"]


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True, help="has Training/<class>/*.jpg and Testing/<class>/*.jpg")
    ap.add_argument("--out", default="runs/cnx_s")
    ap.add_argument("--arch", default="convnext_small.fb_in22k_ft_in1k")
    ap.add_argument("--size", type=int, default=384)
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--bs", type=int, default=24)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=7)
    return ap.parse_args()


def scan(split_dir):
    rows = []
    for c, name in enumerate(CLASSES):
        d = os.path.join(split_dir, name)
        rows += [{"path": os.path.join(d, f), "label": c} for f in sorted(os.listdir(d))]
    return pd.DataFrame(rows)


class MRIDataset(Dataset):
    def __init__(self, df, tf):
        self.paths, self.labels, self.tf = df.path.tolist(), df.label.to_numpy(), tf

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return self.tf(Image.open(self.paths[i]).convert("RGB")), int(self.labels[i]), i


def tfms(size, train):
    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    if train:
        return T.Compose([T.RandomResizedCrop(size, scale=(0.7, 1.0)), T.RandomHorizontalFlip(),
                          T.RandomRotation(10), T.ColorJitter(0.2, 0.2), T.ToTensor(), norm])
    return T.Compose([T.Resize((size, size)), T.ToTensor(), norm])


def gather_probs(idx, probs, world_size):
    parts = [None] * world_size
    dist.all_gather_object(parts, (idx, probs))
    idx = np.concatenate([p[0] for p in parts])
    probs = np.concatenate([p[1] for p in parts])
    idx, keep = np.unique(idx, return_index=True)
    return idx, probs[keep]


@torch.no_grad()
def predict(model, loader, device, tta=False):
    model.eval()
    idx, probs = [], []
    for x, _, i in loader:
        x = x.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(x)
            if tta:
                logits = (logits + model(x.flip(3))) / 2
        probs.append(F.softmax(logits.float(), 1).cpu().numpy())
        idx.append(i.numpy())
    return np.concatenate(idx), np.concatenate(probs)


def train_fold(fold, df, args, rank, local_rank, world_size):
    device = torch.device("cuda", local_rank)
    tr, va = df[df.fold != fold].reset_index(drop=True), df[df.fold == fold].reset_index(drop=True)
    tr_ds, va_ds = MRIDataset(tr, tfms(args.size, True)), MRIDataset(va, tfms(args.size, False))
    tr_sampler = DistributedSampler(tr_ds, shuffle=True, seed=args.seed)
    tr_dl = DataLoader(tr_ds, args.bs, sampler=tr_sampler, num_workers=8, pin_memory=True, drop_last=True)
    va_dl = DataLoader(va_ds, args.bs * 2, sampler=DistributedSampler(va_ds, shuffle=False), num_workers=8)

    model = timm.create_model(args.arch, pretrained=True, num_classes=len(CLASSES), drop_path_rate=0.2)
    model = DDP(model.to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, epochs=args.epochs, steps_per_epoch=len(tr_dl),
                                                pct_start=0.1)
    scaler = torch.cuda.amp.GradScaler()
    crit = nn.CrossEntropyLoss(label_smoothing=0.1)

    best_f1, best = -1.0, None
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y, _ in tr_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = crit(model(x), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()

        idx, probs = gather_probs(*predict(model, va_dl, device), world_size)
        f1 = f1_score(va.label.to_numpy()[idx], probs.argmax(1), average="macro")
        if rank == 0:
            print(f"fold {fold} epoch {epoch} macro-F1 {f1:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if f1 > best_f1:
                torch.save({"state_dict": model.module.state_dict(), "epoch": epoch, "f1": f1},
                           os.path.join(args.out, f"fold{fold}.ckpt"))
        if f1 > best_f1:
            best_f1 = f1
            best = (va.row.to_numpy()[idx], probs)
    return best_f1, best


def ensemble_test(test_df, args, rank, local_rank, world_size):
    device = torch.device("cuda", local_rank)
    ds = MRIDataset(test_df, tfms(args.size, False))
    dl = DataLoader(ds, args.bs * 2, sampler=DistributedSampler(ds, shuffle=False), num_workers=8)
    probs_sum, idx = 0, None
    for fold in range(args.folds):
        ckpt = torch.load(os.path.join(args.out, f"fold{fold}.ckpt"))
        model = timm.create_model(args.arch, pretrained=False, num_classes=len(CLASSES))
        model.load_state_dict(ckpt["state_dict"])
        model.to(device)
        idx, p = predict(model, dl, device, tta=True)
        probs_sum = probs_sum + p
        if rank == 0:
            print(f"loaded fold {fold} (epoch {ckpt['epoch']}, val F1 {ckpt['f1']:.4f})", flush=True)
        del model, ckpt
    return gather_probs(idx, probs_sum / args.folds, world_size)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    os.makedirs(args.out, exist_ok=True)

    df = scan(os.path.join(args.root, "Training"))
    df["row"] = np.arange(len(df))
    df["fold"] = -1
    skf = StratifiedKFold(args.folds, shuffle=True, random_state=args.seed)
    for f, (_, v) in enumerate(skf.split(df, df.label)):
        df.loc[v, "fold"] = f

    oof = np.zeros((len(df), len(CLASSES)), np.float32)
    fold_f1 = []
    for fold in range(args.folds):
        f1, (rows, probs) = train_fold(fold, df, args, rank, local_rank, world_size)
        oof[rows] = probs
        fold_f1.append(f1)
    dist.barrier()

    test_df = scan(os.path.join(args.root, "Testing"))
    idx, test_probs = ensemble_test(test_df, args, rank, local_rank, world_size)
    if rank == 0:
        y = df.label.to_numpy()
        yt = test_df.label.to_numpy()[idx]
        report = {
            "fold_f1": fold_f1,
            "oof_f1": f1_score(y, oof.argmax(1), average="macro"),
            "oof_acc": accuracy_score(y, oof.argmax(1)),
            "test_f1": f1_score(yt, test_probs.argmax(1), average="macro"),
            "test_acc": accuracy_score(yt, test_probs.argmax(1)),
        }
        print(json.dumps(report, indent=2))
        np.save(os.path.join(args.out, "oof.npy"), oof)
        with open(os.path.join(args.out, "report.json"), "w") as fh:
            json.dump(report, fh, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
