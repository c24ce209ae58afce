"""Neural collaborative filtering (NeuMF) on MovieLens-1M implicit feedback.

prepare_data() converts ratings.dat to parquet once; setup() reads the parquet on
every process.  Multi-GPU through the Lightning DDP strategy.

    python 04_recsys_ncf_lightning.py --data-dir data/ml-1m --devices 4
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
from pytorch_lightning.loggers import CSVLogger
from pytorch_lightning.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset
from torchmetrics.classification import BinaryAUROC


class ImplicitTrainSet(Dataset):
    """Every positive is paired with `n_neg` sampled negatives."""

    def __init__(self, users, items, n_items, n_neg=4):
        self.users = users
        self.items = items
        self.n_items = n_items
        self.n_neg = n_neg

    def __len__(self):
        return len(self.users) * (1 + self.n_neg)

    def __getitem__(self, idx):
        pos_idx, k = divmod(idx, 1 + self.n_neg)
        u = self.users[pos_idx]
        if k == 0:
            return u, self.items[pos_idx], 1.0
        return u, np.random.randint(self.n_items), 0.0


class FixedEvalSet(Dataset):
    def __init__(self, frame):
        self.u = frame["user"].values
        self.i = frame["item"].values
        self.y = frame["label"].values.astype(np.float32)

    def __len__(self):
        return len(self.u)

    def __getitem__(self, idx):
        return self.u[idx], self.i[idx], self.y[idx]


def count_entities(ratings_path):
    ids = pd.read_csv(ratings_path, sep="::", engine="python", usecols=[0, 1],
                      names=["user", "item"])
    return int(ids["user"].nunique()), int(ids["item"].nunique())


class MovieLensDM(pl.LightningDataModule):
    def __init__(self, data_dir, batch_size=2048, num_workers=4, n_neg=4, eval_neg=99):
        super().__init__()
        self.data_dir = data_dir
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.n_neg = n_neg
        self.eval_neg = eval_neg
        self.train_pq = os.path.join(data_dir, "train.parquet")
        self.val_pq = os.path.join(data_dir, "val.parquet")
        self.n_users, self.n_items = count_entities(os.path.join(data_dir, "ratings.dat"))

    def prepare_data(self):
        if os.path.exists(self.train_pq) and os.path.exists(self.val_pq):
            return
        df = pd.read_csv(os.path.join(self.data_dir, "ratings.dat"), sep="::", engine="python",
                         names=["user", "item", "rating", "ts"])
        df["user"] = df["user"].astype("category").cat.codes
        df["item"] = df["item"].astype("category").cat.codes
        df = df.sort_values(["user", "ts"])
        last = df.groupby("user").tail(1)
        train = df.drop(last.index)
        n_items = df["item"].max() + 1
        rng = np.random.default_rng(0)
        rows = []
        seen = train.groupby("user")["item"].apply(set).to_dict()
        for u, i in zip(last["user"].values, last["item"].values):
            rows.append((u, i, 1))
            negs = set()
            while len(negs) < self.eval_neg:
                j = int(rng.integers(n_items))
                if j != i and j not in seen.get(u, ()):
                    negs.add(j)
            rows += [(u, j, 0) for j in negs]
        val = pd.DataFrame(rows, columns=["user", "item", "label"])
        tmp_t, tmp_v = f"{self.train_pq}.{os.getpid()}.tmp", f"{self.val_pq}.{os.getpid()}.tmp"
        train[["user", "item"]].to_parquet(tmp_t)
        val.to_parquet(tmp_v)
        os.replace(tmp_t, self.train_pq)
        os.replace(tmp_v, self.val_pq)

    def setup(self, stage=None):
        train = pd.read_parquet(self.train_pq)
        val = pd.read_parquet(self.val_pq)
        self.train_ds = ImplicitTrainSet(train["user"].values, train["item"].values,
                                         self.n_items, self.n_neg)
        self.val_ds = FixedEvalSet(val)

    def train_dataloader(self):
        return DataLoader(self.train_ds, batch_size=self.batch_size, shuffle=True,
                          num_workers=self.num_workers, pin_memory=True, drop_last=True)

    def val_dataloader(self):
        return DataLoader(self.val_ds, batch_size=4096, num_workers=self.num_workers,
                          pin_memory=True)


class NeuMF(pl.LightningModule):
    def __init__(self, n_users, n_items, gmf_dim=32, mlp_dims=(128, 64, 32), lr=1e-3):
        super().__init__()
        self.save_hyperparameters()
        self.gmf_u = nn.Embedding(n_users, gmf_dim)
        self.gmf_i = nn.Embedding(n_items, gmf_dim)
        self.mlp_u = nn.Embedding(n_users, mlp_dims[0] // 2)
        self.mlp_i = nn.Embedding(n_items, mlp_dims[0] // 2)
        layers = []
        for a, b in zip(mlp_dims[:-1], mlp_dims[1:]):
            layers += [nn.Linear(a, b), nn.ReLU(), nn.Dropout(0.1)]
        self.mlp = nn.Sequential(*layers)
        self.out = nn.Linear(gmf_dim + mlp_dims[-1], 1)
        for emb in (self.gmf_u, self.gmf_i, self.mlp_u, self.mlp_i):
            nn.init.normal_(emb.weight, std=0.01)
        self.val_auc = BinaryAUROC()

    def forward(self, u, i):
        g = self.gmf_u(u) * self.gmf_i(i)
        m = self.mlp(torch.cat([self.mlp_u(u), self.mlp_i(i)], dim=-1))
        return self.out(torch.cat([g, m], dim=-1)).squeeze(-1)

    def training_step(self, batch, batch_idx):
        u, i, y = batch
        loss = F.binary_cross_entropy_with_logits(self(u, i), y.float())
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        u, i, y = batch
        logits = self(u, i)
        loss = F.binary_cross_entropy_with_logits(logits, y.float())
        self.val_auc.update(torch.sigmoid(logits), y.long())
        self.log("val_loss", loss, on_epoch=True, sync_dist=True)
        self.log("val_auc", self.val_auc, on_epoch=True, prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", default="data/ml-1m")
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", default="runs/neumf")
    args = ap.parse_args()

    pl.seed_everything(7, workers=True)
    dm = MovieLensDM(args.data_dir, batch_size=args.batch_size)
    rank_zero_info(f"users={dm.n_users} items={dm.n_items}")
    model = NeuMF(dm.n_users, dm.n_items, lr=args.lr)

    trainer = pl.Trainer(
        accelerator="gpu",
        devices=args.devices,
        strategy="ddp",
        max_epochs=args.epochs,
        logger=CSVLogger(args.out),
        callbacks=[ModelCheckpoint(monitor="val_auc", mode="max", save_top_k=1, save_last=True)],
        log_every_n_steps=50,
    )
    trainer.fit(model, datamodule=dm)


if __name__ == "__main__":
    main()
