"""Churn prediction on the telco customer table.

MLP over one-hot categoricals + standardised numerics. Trained with Lightning,
multi-GPU via the built-in DDP strategy.

    python 01_tabular_churn_lightning.py --csv data/telco_churn.csv --devices 4
"""
import argparse
import os

import numpy as np
import pandas as pd
import pytorch_lightning as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from pytorch_lightning.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset

CAT_COLS = ["gender", "Partner", "Dependents", "PhoneService", "MultipleLines",
            "InternetService", "OnlineSecurity", "OnlineBackup", "DeviceProtection",
            "TechSupport", "StreamingTV", "StreamingMovies", "Contract",
            "PaperlessBilling", "PaymentMethod"]
NUM_COLS = ["SeniorCitizen", "tenure", "MonthlyCharges", "TotalCharges"]
TARGET = "Churn"


def load_frame(path):
    df = pd.read_csv(path)
    df["TotalCharges"] = pd.to_numeric(df["TotalCharges"], errors="coerce").fillna(0.0)
    df[TARGET] = (df[TARGET] == "Yes").astype(np.float32)
    df = pd.get_dummies(df, columns=CAT_COLS, dtype=np.float32)
    return df


class ChurnDataModule(pl.LightningDataModule):
    def __init__(self, csv, batch_size=256, num_workers=4, seed=13):
        super().__init__()
        self.csv = csv
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.n_features = None

    def setup(self, stage=None):
        df = load_frame(self.csv)
        feat_cols = [c for c in df.columns if c not in ("customerID", TARGET)]
        tr, va = train_test_split(df, test_size=0.2, random_state=self.seed,
                                  stratify=df[TARGET])
        mu = tr[NUM_COLS].mean()
        sd = tr[NUM_COLS].std() + 1e-6
        tr = tr.copy(); va = va.copy()
        tr[NUM_COLS] = (tr[NUM_COLS] - mu) / sd
        va[NUM_COLS] = (va[NUM_COLS] - mu) / sd
        self.n_features = len(feat_cols)
        self.train_ds = TensorDataset(torch.tensor(tr[feat_cols].values, dtype=torch.float32),
                                      torch.tensor(tr[TARGET].values, dtype=torch.float32))
        self.val_ds = TensorDataset(torch.tensor(va[feat_cols].values, dtype=torch.float32),
                                    torch.tensor(va[TARGET].values, dtype=torch.float32))

    def train_dataloader(self):
        return DataLoader(self.train_ds, batch_size=self.batch_size, shuffle=True,
                          num_workers=self.num_workers, drop_last=True, persistent_workers=True)

    def val_dataloader(self):
        return DataLoader(self.val_ds, batch_size=1024, shuffle=False,
                          num_workers=self.num_workers, persistent_workers=True)


class ChurnMLP(pl.LightningModule):
    def __init__(self, n_features, hidden=(256, 128, 64), dropout=0.2, lr=1e-3, wd=1e-4):
        super().__init__()
        self.save_hyperparameters()
        layers, d = [], n_features
        for h in hidden:
            layers += [nn.Linear(d, h), nn.LayerNorm(h), nn.GELU(), nn.Dropout(dropout)]
            d = h
        layers.append(nn.Linear(d, 1))
        self.net = nn.Sequential(*layers)
        self._val_scores = []
        self._val_targets = []

    def forward(self, x):
        return self.net(x).squeeze(-1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.binary_cross_entropy_with_logits(logits, y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.binary_cross_entropy_with_logits(logits, y)
        self.log("val_loss", loss, on_epoch=True, prog_bar=True, sync_dist=True)
        self._val_scores.append(torch.sigmoid(logits).detach().cpu())
        self._val_targets.append(y.detach().cpu())

    def on_validation_epoch_end(self):
        scores = torch.cat(self._val_scores).numpy()
        targets = torch.cat(self._val_targets).numpy()
        self._val_scores.clear()
        self._val_targets.clear()
        if targets.min() == targets.max():
            return
        auc = roc_auc_score(targets, scores)
        acc = float(((scores > 0.5) == targets).mean())
        self.log("val_auc", auc, prog_bar=True)
        self.log("val_acc", acc)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr,
                                weight_decay=self.hparams.wd)
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=2)
        return {"optimizer": opt,
                "lr_scheduler": {"scheduler": sched, "monitor": "val_auc", "interval": "epoch"}}


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", default="data/telco_churn.csv")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--out", default="runs/churn")
    p.add_argument("--seed", type=int, default=13)
    return p.parse_args()


def main():
    args = parse_args()
    pl.seed_everything(args.seed, workers=True)
    dm = ChurnDataModule(args.csv, batch_size=args.batch_size, seed=args.seed)
    dm.setup()
    model = ChurnMLP(dm.n_features, lr=args.lr)

    ckpt_cb = ModelCheckpoint(dirpath=os.path.join(args.out, "ckpt"), monitor="val_auc",
                              mode="max", save_top_k=2, filename="churn-{epoch:02d}-{val_auc:.4f}")
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_epochs=args.epochs,
        logger=CSVLogger(args.out, name="logs"),
        callbacks=[ckpt_cb, EarlyStopping(monitor="val_auc", mode="max", patience=6),
                   LearningRateMonitor("epoch")],
        log_every_n_steps=20,
        deterministic=True,
    )
    trainer.fit(model, datamodule=dm)
    if trainer.is_global_zero:
        print("best checkpoint:", ckpt_cb.best_model_path, "score:", ckpt_cb.best_model_score)


if __name__ == "__main__":
    main()
