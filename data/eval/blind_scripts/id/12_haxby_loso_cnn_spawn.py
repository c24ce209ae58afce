"""Between-subject decoding of object categories from fMRI (Haxby 2001).

Leave-one-subject-out: for every held-out subject a small 3-D CNN is trained
on the other subjects' ventral-temporal volumes (MNI space, VT mask bounding
box) and tested on the held-out subject.  The folds are independent, so they
are run in parallel, one worker process per GPU; each worker walks through its
own list of folds and writes one JSON per fold.  The parent collects them.

    python 12_haxby_loso_cnn_spawn.py --data /data/haxby_mni --n_gpus 6
"""
import argparse
import json
import os
import time
from pathlib import Path

import nibabel as nib
import numpy as np
import pandas as pd
import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

CATEGORIES = ["bottle", "cat", "chair", "face", "house", "scissors", "scrambledpix", "shoe"]


class SubjectVolumes(Dataset):
    """Masked BOLD volumes of one or more subjects, cropped to the mask's bounding box."""

    def __init__(self, root, subjects, mask_img, augment=False):
        mask = nib.load(mask_img).get_fdata() > 0
        ii, jj, kk = np.where(mask)
        self.box = (slice(ii.min(), ii.max() + 1), slice(jj.min(), jj.max() + 1), slice(kk.min(), kk.max() + 1))
        self.mask = mask[self.box]
        vols, labels = [], []
        for sub in subjects:
            img = nib.load(Path(root) / f"subj{sub}" / "bold_mni.nii.gz")
            data = np.asanyarray(img.dataobj)[self.box].astype(np.float32)  # (x, y, z, t)
            ev = pd.read_csv(Path(root) / f"subj{sub}" / "labels.txt", sep=" ")
            keep = ev["labels"].isin(CATEGORIES).to_numpy()
            data = data[..., keep]
            # voxel-wise z-score within subject (between-subject baseline differences)
            data = (data - data.mean(-1, keepdims=True)) / (data.std(-1, keepdims=True) + 1e-6)
            data *= self.mask[..., None]
            vols.append(np.moveaxis(data, -1, 0))
            labels.append(ev.loc[keep, "labels"].map({c: k for k, c in enumerate(CATEGORIES)}).to_numpy())
        self.x = np.concatenate(vols)
        self.y = np.concatenate(labels).astype(np.int64)
        self.augment = augment

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        x = self.x[i]
        if self.augment:
            x = x + np.random.normal(0, 0.1, x.shape).astype(np.float32)
            if np.random.rand() < 0.5:
                x = x[::-1].copy()  # left-right flip in MNI space
        return torch.from_numpy(np.ascontiguousarray(x))[None], self.y[i]


class VolumeCNN(nn.Module):
    def __init__(self, n_classes=8, width=16):
        super().__init__()
        def block(i, o):
            return nn.Sequential(nn.Conv3d(i, o, 3, padding=1, bias=False), nn.BatchNorm3d(o),
                                 nn.ReLU(inplace=True), nn.MaxPool3d(2))
        self.features = nn.Sequential(block(1, width), block(width, 2 * width), block(2 * width, 4 * width),
                                      nn.AdaptiveAvgPool3d(1), nn.Flatten())
        self.classifier = nn.Sequential(nn.Dropout(0.5), nn.Linear(4 * width, n_classes))

    def forward(self, x):
        return self.classifier(self.features(x))


def run_fold(args, test_sub, device):
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    train_subs = [s for s in args.subjects if s != test_sub]
    train_ds = SubjectVolumes(args.data, train_subs, args.mask, augment=True)
    test_ds = SubjectVolumes(args.data, [test_sub], args.mask)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=4,
                          pin_memory=True, drop_last=True)
    test_dl = DataLoader(test_ds, batch_size=64, shuffle=False, num_workers=2)

    model = VolumeCNN().to(device)
    if args.init:
        # weights of a model pretrained on a larger category-localiser dataset
        state = torch.load(args.init, map_location=device)
        state = {k: v for k, v in state.items() if not k.startswith("classifier.")}
        model.load_state_dict(state, strict=False)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    for epoch in range(args.epochs):
        model.train()
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sched.step()

    model.eval()
    preds = []
    with torch.no_grad():
        for x, _ in test_dl:
            preds.append(model(x.to(device)).argmax(1).cpu())
    preds = torch.cat(preds).numpy()
    acc = float((preds == test_ds.y).mean())
    confusion = np.zeros((len(CATEGORIES), len(CATEGORIES)), dtype=int)
    np.add.at(confusion, (test_ds.y, preds), 1)
    torch.save(model.state_dict(), Path(args.out) / f"fold_sub{test_sub}.pt")
    return acc, confusion


def worker(rank, folds_per_gpu, args):
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    for test_sub in folds_per_gpu[rank]:
        t0 = time.time()
        acc, confusion = run_fold(args, test_sub, device)
        with open(Path(args.out) / f"fold_sub{test_sub}.json", "w") as f:
            json.dump({"test_subject": test_sub, "acc": acc, "confusion": confusion.tolist(),
                       "minutes": (time.time() - t0) / 60}, f)
        print(f"[gpu {rank}] held-out subj{test_sub}: acc {acc:.3f}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/haxby_mni")
    ap.add_argument("--mask", default="/data/haxby_mni/mask_vt_mni.nii.gz")
    ap.add_argument("--subjects", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    ap.add_argument("--n_gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init", default=None)
    ap.add_argument("--out", default="results/haxby_loso")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    n = max(1, min(args.n_gpus, len(args.subjects)))
    folds_per_gpu = [args.subjects[k::n] for k in range(n)]
    mp.spawn(worker, args=(folds_per_gpu, args), nprocs=n, join=True)

    rows = [json.load(open(Path(args.out) / f"fold_sub{s}.json")) for s in args.subjects]
    df = pd.DataFrame([{k: r[k] for k in ("test_subject", "acc", "minutes")} for r in rows])
    df.to_csv(Path(args.out) / "loso.csv", index=False)
    print(df.to_string(index=False))
    print(f"mean LOSO accuracy {df.acc.mean():.3f} +- {df.acc.std():.3f} (chance {1 / len(CATEGORIES):.3f})")


if __name__ == "__main__":
    main()
