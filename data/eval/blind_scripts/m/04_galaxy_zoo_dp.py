#!/usr/bin/env python
# Galaxy Zoo 2 morphology: regress the 37 vote fractions from 424x424 SDSS gri cutouts.
# Started as a notebook, moved to a script so it can run on the 4-GPU workstation.
#
#   CUDA_VISIBLE_DEVICES=0,1,2,3 python 04_galaxy_zoo_dp.py --batch_size 128 --epochs 40
#
import argparse
import os
import time

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as T
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision.models import resnet34
from tqdm import tqdm

parser = argparse.ArgumentParser()
parser.add_argument("--img_dir", default="/data/gz2/images_training_rev1")
parser.add_argument("--labels", default="/data/gz2/training_solutions_rev1.csv")
parser.add_argument("--batch_size", type=int, default=128)
parser.add_argument("--epochs", type=int, default=40)
parser.add_argument("--lr", type=float, default=3e-4)
parser.add_argument("--val_frac", type=float, default=0.1)
parser.add_argument("--workers", type=int, default=12)
parser.add_argument("--out", default="results/gz2_resnet34")
args = parser.parse_args()

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
os.makedirs(args.out, exist_ok=True)


class GalaxyZooDataset(Dataset):
    def __init__(self, df, img_dir, transform):
        self.ids = df["GalaxyID"].values
        self.targets = df.drop(columns=["GalaxyID"]).values.astype(np.float32)
        self.img_dir = img_dir
        self.transform = transform

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.img_dir, f"{self.ids[i]}.jpg")).convert("RGB")
        return self.transform(img), torch.from_numpy(self.targets[i])


train_tf = T.Compose([
    T.CenterCrop(256),
    T.RandomRotation(180),
    T.RandomHorizontalFlip(),
    T.RandomVerticalFlip(),
    T.Resize(128),
    T.ToTensor(),
    T.Normalize([0.094, 0.085, 0.064], [0.124, 0.105, 0.094]),
])
val_tf = T.Compose([
    T.CenterCrop(256),
    T.Resize(128),
    T.ToTensor(),
    T.Normalize([0.094, 0.085, 0.064], [0.124, 0.105, 0.094]),
])


class GalaxyNet(nn.Module):
    """ResNet34 trunk + sigmoid head. Returns the loss directly when targets are given,
    which kept the notebook training cell short."""

    def __init__(self, n_out=37):
        super().__init__()
        self.backbone = resnet34(weights="IMAGENET1K_V1")
        self.backbone.fc = nn.Sequential(nn.Dropout(0.3), nn.Linear(512, n_out))

    def forward(self, x, targets=None):
        pred = torch.sigmoid(self.backbone(x))
        if targets is None:
            return pred
        return F.mse_loss(pred, targets)


def rmse(pred, target):
    return float(np.sqrt(((pred - target) ** 2).mean()))


def plot_curves(hist, path):
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(hist["epoch"], hist["train_rmse"], label="train")
    ax.plot(hist["epoch"], hist["val_rmse"], label="val")
    ax.set_xlabel("epoch")
    ax.set_ylabel("RMSE (vote fractions)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    df = pd.read_csv(args.labels)
    df = df.sample(frac=1.0, random_state=1234).reset_index(drop=True)
    n_val = int(len(df) * args.val_frac)
    val_df, train_df = df.iloc[:n_val], df.iloc[n_val:]
    print(f"train {len(train_df)}  val {len(val_df)}  GPUs {torch.cuda.device_count()}")

    train_dl = DataLoader(GalaxyZooDataset(train_df, args.img_dir, train_tf), batch_size=args.batch_size,
                          shuffle=True, num_workers=args.workers, pin_memory=True, drop_last=True)
    val_dl = DataLoader(GalaxyZooDataset(val_df, args.img_dir, val_tf), batch_size=args.batch_size,
                        shuffle=False, num_workers=args.workers, pin_memory=True)

    model = GalaxyNet()
    if torch.cuda.device_count() > 1:
        model = nn.DataParallel(model)
    model = model.to(device)

    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=15, gamma=0.3)

    hist = {"epoch": [], "train_rmse": [], "val_rmse": []}
    best = 1e9
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        sq_sum, n_seen = 0.0, 0
        pbar = tqdm(train_dl, desc=f"epoch {epoch}", leave=False)
        for imgs, targets in pbar:
            imgs = imgs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            optimizer.zero_grad()
            loss = model(imgs, targets)
            loss.backward()
            optimizer.step()
            sq_sum += loss.item() * imgs.size(0)
            n_seen += imgs.size(0)
            pbar.set_postfix(loss=f"{loss.item():.4f}")
        scheduler.step()
        train_rmse = float(np.sqrt(sq_sum / n_seen))

        model.eval()
        preds, trues = [], []
        with torch.no_grad():
            for imgs, targets in val_dl:
                preds.append(model(imgs.to(device)).cpu().numpy())
                trues.append(targets.numpy())
        val_rmse = rmse(np.concatenate(preds), np.concatenate(trues))

        hist["epoch"].append(epoch)
        hist["train_rmse"].append(train_rmse)
        hist["val_rmse"].append(val_rmse)
        print(f"epoch {epoch:02d}  train {train_rmse:.5f}  val {val_rmse:.5f}  {time.time() - t0:.0f}s")
        pd.DataFrame(hist).to_csv(os.path.join(args.out, "history.csv"), index=False)
        plot_curves(hist, os.path.join(args.out, "curves.png"))

        if val_rmse < best:
            best = val_rmse
            state = model.module.state_dict() if isinstance(model, nn.DataParallel) else model.state_dict()
            torch.save(state, os.path.join(args.out, "best.pt"))

    print(f"best val RMSE {best:.5f}")


if __name__ == "__main__":
    main()
