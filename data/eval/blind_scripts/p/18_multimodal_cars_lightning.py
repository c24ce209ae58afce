"""Used-car price estimation from one listing photo + structured specs.

ResNet-50 image tower, entity embeddings for make/model/fuel/gearbox, numeric specs.
Lightning DDP; the test split is scored separately (score_cars.py) on one GPU.

    python 18_multimodal_cars_lightning.py --root data/cars --devices 4
"""
import argparse
import json
import os

import numpy as np
import pandas as pd
import pytorch_lightning as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger
from pytorch_lightning.utilities import rank_zero_only
from torch.utils.data import DataLoader, Dataset
from torchmetrics import MeanAbsoluteError, MeanAbsolutePercentageError
from torchvision import transforms as T

CAT = ["make", "model", "fuel", "gearbox", "body_type"]
NUM = ["year", "mileage_km", "power_hp", "engine_cc", "doors", "owners"]


def build_vocab(series):
    return {v: i + 1 for i, v in enumerate(sorted(series.astype(str).unique()))}


class CarSet(Dataset):
    def __init__(self, df, root, vocab, mu, sd, train):
        self.files = [os.path.join(root, "photos", f) for f in df["photo"]]
        self.cat = np.stack([df[c].astype(str).map(vocab[c]).fillna(0).astype(np.int64) for c in CAT], 1)
        self.num = ((df[NUM] - mu) / sd).fillna(0).values.astype(np.float32)
        self.y = np.log(df["price_eur"].values.astype(np.float32))
        base = [T.Resize(256), T.CenterCrop(224)] if not train else \
            [T.RandomResizedCrop(224, scale=(0.7, 1.0)), T.RandomHorizontalFlip(), T.ColorJitter(0.1, 0.1, 0.1)]
        self.tf = T.Compose(base + [T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        img = self.tf(Image.open(self.files[i]).convert("RGB"))
        return img, torch.from_numpy(self.cat[i]), torch.from_numpy(self.num[i]), torch.tensor(self.y[i])


class CarsDM(pl.LightningDataModule):
    def __init__(self, root, bs=32, workers=8):
        super().__init__()
        self.root, self.bs, self.workers = root, bs, workers
        df = pd.read_csv(os.path.join(root, "listings.csv"))
        self.df = df[(df["price_eur"] > 300) & (df["price_eur"] < 300_000)].reset_index(drop=True)
        self.train_df = self.df[self.df["split"] == "train"]
        self.vocab = {c: build_vocab(self.train_df[c]) for c in CAT}
        self.cards = [len(self.vocab[c]) + 1 for c in CAT]

    def setup(self, stage=None):
        mu, sd = self.train_df[NUM].mean(), self.train_df[NUM].std() + 1e-6
        mk = lambda split, train: CarSet(self.df[self.df["split"] == split], self.root, self.vocab, mu, sd, train)
        self.train_ds, self.val_ds = mk("train", True), mk("val", False)

    def train_dataloader(self):
        return DataLoader(self.train_ds, batch_size=self.bs, shuffle=True, num_workers=self.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)

    def val_dataloader(self):
        return DataLoader(self.val_ds, batch_size=self.bs * 2, num_workers=self.workers, pin_memory=True)


class CarPriceModel(pl.LightningModule):
    def __init__(self, cards, n_num, lr=3e-4, epochs=20):
        super().__init__()
        self.save_hyperparameters()
        cnn = torchvision.models.resnet50(weights=torchvision.models.ResNet50_Weights.IMAGENET1K_V2)
        img_dim = cnn.fc.in_features
        cnn.fc = nn.Identity()
        self.cnn = cnn
        self.embs = nn.ModuleList([nn.Embedding(c, min(32, 4 + c // 4)) for c in cards])
        tab_in = sum(e.embedding_dim for e in self.embs) + n_num
        self.tab = nn.Sequential(nn.Linear(tab_in, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(img_dim + 128, 256), nn.ReLU(), nn.Dropout(0.2), nn.Linear(256, 1))
        self.val_mae = MeanAbsoluteError()
        self.val_mape = MeanAbsolutePercentageError()

    def forward(self, img, cat, num):
        e = torch.cat([emb(cat[:, i]) for i, emb in enumerate(self.embs)], 1)
        return self.head(torch.cat([self.cnn(img), self.tab(torch.cat([e, num], 1))], 1)).squeeze(1)

    def training_step(self, batch, batch_idx):
        img, cat, num, y = batch
        loss = F.smooth_l1_loss(self(img, cat, num), y, beta=0.1)
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def _eval(self, batch, mae, mape, prefix):
        img, cat, num, y = batch
        pred = self(img, cat, num)
        self.log(f"{prefix}_loss", F.smooth_l1_loss(pred, y, beta=0.1), sync_dist=True)
        price_pred, price = torch.exp(pred.float()), torch.exp(y.float())
        mae.update(price_pred, price)
        mape.update(price_pred, price)
        self.log(f"{prefix}_mae_eur", mae, prog_bar=True)
        self.log(f"{prefix}_mape", mape)

    def validation_step(self, batch, batch_idx):
        self._eval(batch, self.val_mae, self.val_mape, "val")

    def configure_optimizers(self):
        opt = torch.optim.AdamW([
            {"params": self.cnn.parameters(), "lr": self.hparams.lr * 0.1},
            {"params": list(self.embs.parameters()) + list(self.tab.parameters()) + list(self.head.parameters())},
        ], lr=self.hparams.lr, weight_decay=1e-4)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.hparams.epochs)
        return [opt], [sched]


@rank_zero_only
def write_summary(path, payload):
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="data/cars")
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--out", default="runs/cars")
    args = ap.parse_args()

    pl.seed_everything(8, workers=True)
    dm = CarsDM(args.root, bs=args.bs)
    model = CarPriceModel(dm.cards, len(NUM), lr=args.lr, epochs=args.epochs)
    ckpt = ModelCheckpoint(dirpath=os.path.join(args.out, "ckpt"), monitor="val_mae_eur", mode="min",
                           save_top_k=1, filename="{epoch}-{val_mae_eur:.0f}")
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=args.devices,
        strategy="ddp",
        sync_batchnorm=True,
        precision="16-mixed",
        max_epochs=args.epochs,
        logger=CSVLogger(args.out),
        callbacks=[ckpt, EarlyStopping(monitor="val_mae_eur", mode="min", patience=5)],
    )
    trainer.fit(model, datamodule=dm)
    best = ckpt.best_model_score
    write_summary(os.path.join(args.out, "summary.json"),
                  {"best_ckpt": ckpt.best_model_path, "best_val_mae_eur": float(best) if best is not None else None,
                   "epochs_run": trainer.current_epoch})


if __name__ == "__main__":
    main()
