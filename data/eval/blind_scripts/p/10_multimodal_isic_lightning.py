"""Melanoma classification: dermoscopy image + patient metadata (age, sex, site).

EfficientNet-B0 image tower + small metadata MLP, late fusion.  Heavy class
imbalance (~1.8% positive) -> BCE with pos_weight.

    python 10_multimodal_isic_lightning.py --root data/isic2020 --gpus 4 --epochs 15
"""
import argparse
import os

import numpy as np
import pandas as pd
import pytorch_lightning as pl
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import WandbLogger
from sklearn.model_selection import StratifiedGroupKFold
from torch.utils.data import DataLoader, Dataset
from torchmetrics.classification import BinaryAUROC
from torchvision import transforms as T

SITES = ["head/neck", "upper extremity", "lower extremity", "torso", "palms/soles", "oral/genital", "unknown"]


def meta_features(df):
    age = (df["age_approx"].fillna(50) / 90.0).values[:, None]
    sex = (df["sex"] == "male").astype(np.float32).values[:, None]
    site = np.stack([(df["anatom_site_general_challenge"].fillna("unknown") == s).values for s in SITES], 1)
    return np.concatenate([age, sex, site], 1).astype(np.float32)


class LesionDataset(Dataset):
    def __init__(self, df, img_dir, size, train):
        self.paths = [os.path.join(img_dir, f"{n}.jpg") for n in df["image_name"]]
        self.meta = meta_features(df)
        self.y = df["target"].values.astype(np.float32)
        if train:
            self.tf = T.Compose([T.RandomResizedCrop(size, scale=(0.7, 1.0)), T.RandomHorizontalFlip(),
                                 T.RandomVerticalFlip(), T.ColorJitter(0.1, 0.1, 0.1, 0.02),
                                 T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
        else:
            self.tf = T.Compose([T.Resize(size), T.CenterCrop(size), T.ToTensor(),
                                 T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = self.tf(Image.open(self.paths[i]).convert("RGB"))
        return img, torch.from_numpy(self.meta[i]), torch.tensor(self.y[i])


class ISICData(pl.LightningDataModule):
    def __init__(self, root, fold=0, size=384, bs=32, workers=8):
        super().__init__()
        self.root, self.fold, self.size, self.bs, self.workers = root, fold, size, bs, workers
        df = pd.read_csv(os.path.join(root, "train.csv"))
        sgkf = StratifiedGroupKFold(n_splits=5, shuffle=True, random_state=42)
        df["fold"] = -1
        for k, (_, va) in enumerate(sgkf.split(df, df["target"], groups=df["patient_id"])):
            df.loc[df.index[va], "fold"] = k
        self.df = df

    @property
    def pos_fraction(self):
        return float(self.df.loc[self.df.fold != self.fold, "target"].mean())

    def setup(self, stage=None):
        img_dir = os.path.join(self.root, "jpeg", "train")
        self.train_ds = LesionDataset(self.df[self.df.fold != self.fold], img_dir, self.size, True)
        self.val_ds = LesionDataset(self.df[self.df.fold == self.fold], img_dir, self.size, False)

    def train_dataloader(self):
        return DataLoader(self.train_ds, batch_size=self.bs, shuffle=True, num_workers=self.workers,
                          pin_memory=True, drop_last=True)

    def val_dataloader(self):
        return DataLoader(self.val_ds, batch_size=self.bs * 2, num_workers=self.workers, pin_memory=True)


class MelanomaNet(pl.LightningModule):
    def __init__(self, backbone="efficientnet_b0", n_meta=9, pos_fraction=0.018, lr=2e-4, epochs=15):
        super().__init__()
        self.save_hyperparameters()
        self.cnn = timm.create_model(backbone, pretrained=True, num_classes=0)
        self.meta = nn.Sequential(nn.Linear(n_meta, 64), nn.BatchNorm1d(64), nn.SiLU(), nn.Dropout(0.2),
                                  nn.Linear(64, 32), nn.SiLU())
        self.head = nn.Sequential(nn.Dropout(0.3), nn.Linear(self.cnn.num_features + 32, 1))
        pw = min((1.0 - pos_fraction) / pos_fraction, 20.0)
        self.pos_weight = torch.tensor([pw]).cuda()
        self.val_auc = BinaryAUROC()

    def forward(self, img, meta):
        return self.head(torch.cat([self.cnn(img), self.meta(meta)], 1)).squeeze(1)

    def training_step(self, batch, batch_idx):
        img, meta, y = batch
        logits = self(img, meta)
        loss = F.binary_cross_entropy_with_logits(logits, y, pos_weight=self.pos_weight)
        self.log("train_loss", loss, on_epoch=True, sync_dist=True, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        img, meta, y = batch
        logits = self(img, meta)
        loss = F.binary_cross_entropy_with_logits(logits, y, pos_weight=self.pos_weight)
        self.val_auc.update(torch.sigmoid(logits.float()), y.long())
        self.log("val_loss", loss, on_epoch=True, sync_dist=True)
        self.log("val_auc", self.val_auc, on_epoch=True, prog_bar=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=1e-2)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.hparams.lr,
                                                    total_steps=self.trainer.estimated_stepping_batches,
                                                    pct_start=0.1)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="data/isic2020")
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--bs", type=int, default=32)
    p.add_argument("--size", type=int, default=384)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--backbone", default="efficientnet_b0")
    args = p.parse_args()

    pl.seed_everything(42, workers=True)
    dm = ISICData(args.root, fold=args.fold, size=args.size, bs=args.bs)
    model = MelanomaNet(args.backbone, pos_fraction=dm.pos_fraction, lr=args.lr, epochs=args.epochs)
    logger = WandbLogger(project="isic-melanoma", name=f"{args.backbone}-f{args.fold}-{args.size}")
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=args.gpus,
        strategy="ddp",
        sync_batchnorm=True,
        precision="16-mixed",
        max_epochs=args.epochs,
        logger=logger,
        callbacks=[ModelCheckpoint(dirpath=f"ckpt/fold{args.fold}", monitor="val_auc", mode="max",
                                   save_top_k=1, filename="{epoch}-{val_auc:.4f}")],
        log_every_n_steps=25,
    )
    trainer.fit(model, datamodule=dm)


if __name__ == "__main__":
    main()
