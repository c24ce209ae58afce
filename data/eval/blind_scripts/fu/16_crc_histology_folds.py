"""NCT-CRC-HE-100K colorectal tissue classification (9 classes): k-fold + CRC-VAL-HE-7K ensemble.

Every fold runs in a fresh NCCL process group (set up and torn down in `fold_context`).

    torchrun --nproc_per_node=4 16_crc_histology_folds.py --train-dir /data/NCT-CRC-HE-100K --val-dir /data/CRC-VAL-HE-7K
"""
import argparse
import contextlib
import os
import time

import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import balanced_accuracy_score
from sklearn.model_selection import StratifiedKFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms as T


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-dir", required=True)
    ap.add_argument("--val-dir", required=True, help="external test set, same class folders")
    ap.add_argument("--out", default="out/crc_vits16")
    ap.add_argument("--arch", default="vit_small_patch16_224.augreg_in21k_ft_in1k")
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--bs", type=int, default=128)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--workers", type=int, default=10)
    return ap.parse_args()


@contextlib.contextmanager
def fold_context():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    try:
        yield dist.get_rank(), local_rank, dist.get_world_size()
    finally:
        dist.barrier()
        dist.destroy_process_group()


class IndexedSubset(torch.utils.data.Dataset):
    def __init__(self, base, indices, tf):
        self.base, self.indices, self.tf = base, np.asarray(indices), tf

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        j = int(self.indices[i])
        img, y = self.base[j]
        return self.tf(img), y, j


def tf(train):
    norm = T.Normalize([0.5, 0.5, 0.5], [0.5, 0.5, 0.5])
    if train:
        return T.Compose([T.RandomResizedCrop(224, scale=(0.6, 1.0)), T.RandomHorizontalFlip(),
                          T.RandomVerticalFlip(), T.RandomApply([T.ColorJitter(0.3, 0.3, 0.3, 0.05)], p=0.8),
                          T.ToTensor(), norm])
    return T.Compose([T.Resize(224), T.ToTensor(), norm])


@torch.no_grad()
def predict(model, loader, device, world_size, tta=False):
    model.eval()
    ids, probs = [], []
    for x, _, j in loader:
        x = x.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logit = model(x)
            if tta:
                logit = logit + model(x.flip(2)) + model(x.flip(3)) + model(x.transpose(2, 3))
        probs.append(F.softmax(logit.float(), 1).cpu().numpy())
        ids.append(j.numpy())
    parts = [None] * world_size
    dist.all_gather_object(parts, (np.concatenate(ids), np.concatenate(probs)))
    ids = np.concatenate([p[0] for p in parts])
    probs = np.concatenate([p[1] for p in parts])
    ids, keep = np.unique(ids, return_index=True)
    return ids, probs[keep]


def train_fold(fold, base, labels, folds, args):
    with fold_context() as (rank, local_rank, world_size):
        device = torch.device("cuda", local_rank)
        tr_ds = IndexedSubset(base, np.where(folds != fold)[0], tf(True))
        va_ds = IndexedSubset(base, np.where(folds == fold)[0], tf(False))
        tr_sampler = DistributedSampler(tr_ds, shuffle=True)
        tr_dl = DataLoader(tr_ds, args.bs, sampler=tr_sampler, num_workers=args.workers, drop_last=True,
                           pin_memory=True)
        va_dl = DataLoader(va_ds, args.bs * 2, sampler=DistributedSampler(va_ds, shuffle=False),
                           num_workers=args.workers, pin_memory=True)

        model = timm.create_model(args.arch, pretrained=True, num_classes=9).to(device)
        model = DDP(model, device_ids=[local_rank])
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
        steps = args.epochs * len(tr_dl)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, total_steps=steps, pct_start=0.1)

        best, best_oof = -1.0, None
        for epoch in range(args.epochs):
            tr_sampler.set_epoch(epoch)
            model.train()
            t0 = time.time()
            for x, y, _ in tr_dl:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()

            ids, probs = predict(model, va_dl, device, world_size)
            bacc = balanced_accuracy_score(labels[ids], probs.argmax(1))
            if rank == 0:
                print(f"fold {fold} ep {epoch} bal-acc {bacc:.4f} ({time.time() - t0:.0f}s)", flush=True)
                if bacc > best:
                    torch.save(model.module.state_dict(), os.path.join(args.out, f"fold{fold}.pt"))
            if bacc > best:
                best, best_oof = bacc, (ids, probs)
        return best, best_oof


def ensemble_external(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    ext = datasets.ImageFolder(args.val_dir)
    ds = IndexedSubset(ext, np.arange(len(ext)), tf(False))
    dl = DataLoader(ds, args.bs * 2, sampler=DistributedSampler(ds, shuffle=False), num_workers=args.workers)
    total = 0
    for fold in range(args.folds):
        net = timm.create_model(args.arch, pretrained=False, num_classes=9)
        net.load_state_dict(torch.load(os.path.join(args.out, f"fold{fold}.pt"), map_location="cpu"))
        ids, probs = predict(net.to(device), dl, device, world_size, tta=True)
        total = total + probs
    if rank == 0:
        y = np.array(ext.targets)[ids]
        print(f"external CRC-VAL-HE-7K ensemble bal-acc {balanced_accuracy_score(y, total.argmax(1)):.4f}")
        np.save(os.path.join(args.out, "external_probs.npy"), total / args.folds)


def main():
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    base = datasets.ImageFolder(args.train_dir)
    labels = np.array(base.targets)
    folds = np.full(len(labels), -1)
    skf = StratifiedKFold(n_splits=args.folds, shuffle=True, random_state=0)
    for f, (_, v) in enumerate(skf.split(np.zeros(len(labels)), labels)):
        folds[v] = f

    oof = np.zeros((len(labels), 9), np.float32)
    for fold in range(args.folds):
        score, (ids, probs) = train_fold(fold, base, labels, folds, args)
        oof[ids] = probs
    if int(os.environ["RANK"]) == 0:
        print(f"OOF bal-acc {balanced_accuracy_score(labels, oof.argmax(1)):.4f}")
        np.save(os.path.join(args.out, "oof.npy"), oof)

    ensemble_external(args)


if __name__ == "__main__":
    main()
