"""Drought-stress classification of maize plots from UAV hyperspectral cubes.

Headwall Nano-Hyperspec cubes (270 bands, 400-1000 nm) clipped per plot and
stored as .npy (bands, H, W). A band-attention block learns a soft band
selection; an L1 penalty on the attention weights keeps it sparse so the
selected wavelengths can be reported.

Runs on the two-GPU phenotyping workstation:
    CUDA_VISIBLE_DEVICES=0,1 python 13_hyperspectral_band_attention_dp.py --data /data/hsi_drought
"""
import argparse
import json
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

CLASSES = ["well_watered", "moderate_stress", "severe_stress"]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--bands", type=int, default=270)
    p.add_argument("--patch", type=int, default=32)
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--l1", type=float, default=1e-3, help="sparsity weight on band attention")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--out", default="results/hsi_band_att")
    return p.parse_args()


class HSIPlots(Dataset):
    def __init__(self, root, split, patch, train):
        meta = pd.read_csv(os.path.join(root, "plots.csv"))
        meta = meta[meta.split == split].reset_index(drop=True)
        self.cubes = [np.load(os.path.join(root, "cubes", f), mmap_mode="r") for f in meta.cube]
        self.y = meta.label.map({c: i for i, c in enumerate(CLASSES)}).values
        stats = np.load(os.path.join(root, "band_stats.npz"))
        self.mean = stats["mean"][:, None, None].astype(np.float32)
        self.std = stats["std"][:, None, None].astype(np.float32)
        self.patch = patch
        self.train = train

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        cube = self.cubes[i]
        _, h, w = cube.shape
        p = self.patch
        if self.train:
            t, l = np.random.randint(0, h - p + 1), np.random.randint(0, w - p + 1)
        else:
            t, l = (h - p) // 2, (w - p) // 2
        x = (np.asarray(cube[:, t:t + p, l:l + p], dtype=np.float32) - self.mean) / self.std
        if self.train:
            if np.random.rand() < 0.5:
                x = x[:, :, ::-1]
            if np.random.rand() < 0.5:
                x = x[:, ::-1, :]
            # smooth multiplicative noise across the spectrum (illumination / BRDF)
            x = x * (1 + 0.03 * np.interp(np.arange(x.shape[0]), [0, x.shape[0] - 1], np.random.randn(2)))[:, None, None]
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)), int(self.y[i])


class BandAttention(nn.Module):
    def __init__(self, bands, hidden=64):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(bands, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, bands))

    def forward(self, x):
        w = torch.sigmoid(self.fc(x.mean(dim=(2, 3))))
        return x * w[:, :, None, None], w


class SpectralSpatialNet(nn.Module):
    def __init__(self, bands, num_classes):
        super().__init__()
        self.band_att = BandAttention(bands)
        self.spectral = nn.Sequential(
            nn.Conv3d(1, 16, (7, 1, 1), padding=(3, 0, 0)), nn.BatchNorm3d(16), nn.ReLU(inplace=True),
            nn.Conv3d(16, 16, (7, 3, 3), stride=(4, 1, 1), padding=(3, 1, 1)), nn.BatchNorm3d(16), nn.ReLU(inplace=True),
        )
        red = (bands + 3) // 4
        self.spatial = nn.Sequential(
            nn.Conv2d(16 * red, 256, 1), nn.BatchNorm2d(256), nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, 3, 2, 1), nn.BatchNorm2d(256), nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, 3, 2, 1), nn.BatchNorm2d(256), nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.fc = nn.Sequential(nn.Dropout(0.4), nn.Linear(256, num_classes))
        self.band_weights = None

    def forward(self, x):
        x, w = self.band_att(x)
        self.band_weights = w
        f = self.spectral(x.unsqueeze(1))
        b, c, d, h, wd = f.shape
        f = self.spatial(f.reshape(b, c * d, h, wd))
        return self.fc(f)


def main():
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda")
    torch.backends.cudnn.benchmark = True

    train_ds = HSIPlots(args.data, "train", args.patch, train=True)
    val_ds = HSIPlots(args.data, "val", args.patch, train=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=256, shuffle=False, num_workers=args.workers)

    model = SpectralSpatialNet(args.bands, len(CLASSES))
    n_gpu = torch.cuda.device_count()
    if n_gpu > 1:
        print(f"using DataParallel on {n_gpu} GPUs")
        model = nn.DataParallel(model)
    model.to(device)
    net = model.module if isinstance(model, nn.DataParallel) else model

    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=8)
    class_counts = np.bincount(train_ds.y, minlength=len(CLASSES))
    weight = torch.tensor(class_counts.sum() / (len(CLASSES) * class_counts), dtype=torch.float32, device=device)

    best_acc, history = 0.0, []
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        tl, tn = 0.0, 0
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            ce = F.cross_entropy(logits, y, weight=weight)
            sparsity = net.band_weights.abs().mean()
            loss = ce + args.l1 * sparsity
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            tl += ce.item() * x.size(0)
            tn += x.size(0)

        model.eval()
        correct, total = 0, 0
        att_sum = torch.zeros(args.bands, device=device)
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device), y.to(device)
                pred = model(x).argmax(1)
                correct += (pred == y).sum().item()
                total += y.numel()
                _, w = net.band_att(x)
                att_sum += w.sum(0)
        acc = correct / total
        scheduler.step(acc)
        top_bands = torch.topk(att_sum / total, 10).indices.sort().values.tolist()
        rec = {"epoch": epoch, "train_ce": tl / tn, "val_acc": acc, "top_bands": top_bands,
               "lr": optimizer.param_groups[0]["lr"], "sec": round(time.time() - t0, 1)}
        history.append(rec)
        print(json.dumps(rec), flush=True)
        if acc > best_acc:
            best_acc = acc
            torch.save(net.state_dict(), os.path.join(args.out, "best.pt"))

    with open(os.path.join(args.out, "history.json"), "w") as f:
        json.dump(history, f, indent=1)
    print(f"best val acc {best_acc:.4f}")


if __name__ == "__main__":
    main()
