"""DeepFM click-through-rate model on a Criteo-like day of logs.

13 integer features (log-transformed), 26 hashed categorical features.
Negatives are down-sampled at load time; categorical strings are hashed to uint64
once, the bucket count is applied per batch so it can be changed without reloading.

    python 19_recsys_deepfm_ctr_spawn.py --data data/criteo_day0.parquet --gpus 4
"""
import argparse
import os

import numpy as np
import pandas as pd
import pytorch_lightning as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset
from torchmetrics.classification import BinaryAUROC

INT_COLS = [f"I{i}" for i in range(1, 14)]
CAT_COLS = [f"C{i}" for i in range(1, 27)]


def hash_column(values, salt):
    return pd.util.hash_array(values.astype(object), hash_key=f"criteo-field-{salt:03d}")


def collate_rows(rows, n_buckets):
    dense = torch.from_numpy(np.stack([r[0] for r in rows]))
    hashed = np.stack([r[1] for r in rows])
    sparse = torch.from_numpy((hashed % np.uint64(n_buckets)).astype(np.int64))
    label = torch.tensor([r[2] for r in rows], dtype=torch.float32)
    return dense, sparse, label


class CriteoRows(Dataset):
    def __init__(self, frame):
        self.dense = np.log1p(frame[INT_COLS].fillna(0).clip(lower=0).values.astype(np.float32))
        cats = frame[CAT_COLS].fillna("").astype(str)
        self.cats = np.stack([hash_column(cats[c].values, j) for j, c in enumerate(CAT_COLS)], 1)
        self.y = frame["label"].values.astype(np.float32)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.dense[i], self.cats[i], self.y[i]


class CriteoDM(pl.LightningDataModule):
    def __init__(self, path, n_buckets=200_000, neg_rate=0.25, bs=8192, workers=6):
        super().__init__()
        self.path, self.n_buckets, self.neg_rate, self.bs, self.workers = path, n_buckets, neg_rate, bs, workers
        self.collate = lambda rows: collate_rows(rows, self.n_buckets)

    def setup(self, stage=None):
        df = pd.read_parquet(self.path)
        rng = np.random.default_rng(0)
        keep = (df["label"] == 1) | (rng.random(len(df)) < self.neg_rate)
        df = df[keep].reset_index(drop=True)
        cut = int(len(df) * 0.95)
        self.train_ds, self.val_ds = CriteoRows(df.iloc[:cut]), CriteoRows(df.iloc[cut:])

    def train_dataloader(self):
        return DataLoader(self.train_ds, batch_size=self.bs, shuffle=True, num_workers=self.workers,
                          collate_fn=self.collate, drop_last=True)

    def val_dataloader(self):
        return DataLoader(self.val_ds, batch_size=self.bs, num_workers=self.workers, collate_fn=self.collate)


class DeepFM(pl.LightningModule):
    def __init__(self, n_buckets, n_fields=26, n_dense=13, k=16, hidden=(400, 400, 400), lr=1e-3, neg_rate=0.25):
        super().__init__()
        self.save_hyperparameters()
        self.emb = nn.Embedding(n_buckets * n_fields, k)
        self.lin = nn.Embedding(n_buckets * n_fields, 1)
        self.dense_lin = nn.Linear(n_dense, 1)
        self.dense_proj = nn.Linear(n_dense, k)
        self.register_buffer("offsets", torch.arange(n_fields) * n_buckets)
        layers, d = [], (n_fields + 1) * k
        for h in hidden:
            layers += [nn.Linear(d, h), nn.BatchNorm1d(h), nn.ReLU(), nn.Dropout(0.1)]
            d = h
        self.dnn = nn.Sequential(*layers, nn.Linear(d, 1))
        nn.init.normal_(self.emb.weight, std=1e-3)
        nn.init.zeros_(self.lin.weight)
        self.val_auc = BinaryAUROC()

    def forward(self, dense, sparse):
        idx = sparse + self.offsets
        v = torch.cat([self.emb(idx), self.dense_proj(dense).unsqueeze(1)], 1)   # [B, F+1, k]
        fm = 0.5 * (v.sum(1).pow(2) - v.pow(2).sum(1)).sum(1, keepdim=True)
        first = self.lin(idx).sum(1) + self.dense_lin(dense)
        return (first + fm + self.dnn(v.flatten(1))).squeeze(1)

    def training_step(self, batch, batch_idx):
        dense, sparse, y = batch
        loss = F.binary_cross_entropy_with_logits(self(dense, sparse), y)
        self.log("train_logloss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        dense, sparse, y = batch
        logits = self(dense, sparse)
        # undo negative down-sampling for a calibrated logloss
        p = torch.sigmoid(logits.float())
        p_cal = (p / (p + (1 - p) / self.hparams.neg_rate)).clamp(1e-7, 1 - 1e-7)
        logloss = -(y * p_cal.log() + (1 - y) * (1 - p_cal).log()).mean()
        self.log("val_logloss", logloss, sync_dist=True)
        self.val_auc.update(p, y.long())
        self.log("val_auc", self.val_auc, prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/criteo_day0.parquet")
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--bs", type=int, default=8192)
    ap.add_argument("--buckets", type=int, default=200_000)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--neg-rate", type=float, default=0.25)
    args = ap.parse_args()

    pl.seed_everything(99)
    dm = CriteoDM(args.data, n_buckets=args.buckets, neg_rate=args.neg_rate, bs=args.bs)
    model = DeepFM(args.buckets, lr=args.lr, neg_rate=args.neg_rate)
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=args.gpus,
        strategy="ddp_spawn",
        max_epochs=args.epochs,
        precision="16-mixed",
        callbacks=[ModelCheckpoint(monitor="val_auc", mode="max", save_last=True)],
        val_check_interval=0.5,
    )
    trainer.fit(model, datamodule=dm)


if __name__ == "__main__":
    main()
