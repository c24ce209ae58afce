# Electricity load forecasting (hourly, 370 clients) with a small TCN.
# Sliding windows: 168h context -> 24h horizon.  Lightning DDP.
#
# usage: python 02_ts_electricity_lightning.py --data data/LD2011_2014.parquet --gpus 4
import argparse
import math
import os
import time

import numpy as np
import pandas as pd
import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, Dataset

CONTEXT = 168
HORIZON = 24


class WindowDataset(Dataset):
    def __init__(self, values, start, end, context=CONTEXT, horizon=HORIZON, stride=6):
        # values: [T, n_series] float32, already scaled per series
        self.values = values
        self.context = context
        self.horizon = horizon
        self.index = []
        for s in range(values.shape[1]):
            for t in range(start, end - context - horizon, stride):
                self.index.append((s, t))

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        s, t = self.index[i]
        x = self.values[t:t + self.context, s]
        y = self.values[t + self.context:t + self.context + self.horizon, s]
        return torch.from_numpy(x).unsqueeze(0), torch.from_numpy(y), s


class ElectricityDM(pl.LightningDataModule):
    def __init__(self, path, batch_size=512, workers=6):
        super().__init__()
        self.path = path
        self.batch_size = batch_size
        self.workers = workers

    def setup(self, stage=None):
        df = pd.read_parquet(self.path)
        df = df.resample("1h").mean().fillna(0.0)
        vals = df.values.astype(np.float32)
        n = len(vals)
        split = int(n * 0.85)
        mu = vals[:split].mean(0, keepdims=True)
        sd = vals[:split].std(0, keepdims=True) + 1e-3
        vals = (vals - mu) / sd
        self.scale = sd.squeeze(0)
        self.train_ds = WindowDataset(vals, 0, split)
        self.val_ds = WindowDataset(vals, split - CONTEXT, n, stride=24)

    def train_dataloader(self):
        return DataLoader(self.train_ds, batch_size=self.batch_size, shuffle=True,
                          num_workers=self.workers, pin_memory=True, drop_last=True)

    def val_dataloader(self):
        return DataLoader(self.val_ds, batch_size=self.batch_size, shuffle=False,
                          num_workers=self.workers, pin_memory=True)


class CausalBlock(nn.Module):
    def __init__(self, ch, dilation, k=3, p=0.1):
        super().__init__()
        self.pad = (k - 1) * dilation
        self.conv1 = nn.Conv1d(ch, ch, k, dilation=dilation)
        self.conv2 = nn.Conv1d(ch, ch, k, dilation=dilation)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        h = F.gelu(self.conv1(F.pad(x, (self.pad, 0))))
        h = self.drop(h)
        h = self.conv2(F.pad(h, (self.pad, 0)))
        return F.gelu(x + h)


class TCNForecaster(pl.LightningModule):
    def __init__(self, channels=64, levels=6, lr=2e-3, n_series=370, emb_dim=16):
        super().__init__()
        self.save_hyperparameters()
        self.series_emb = nn.Embedding(n_series, emb_dim)
        self.inp = nn.Conv1d(1 + emb_dim, channels, 1)
        self.blocks = nn.Sequential(*[CausalBlock(channels, 2 ** i) for i in range(levels)])
        self.head = nn.Linear(channels, HORIZON)
        self._val_abs = []
        self._val_sq = []
        self._t0 = None

    def forward(self, x, sid):
        e = self.series_emb(sid).unsqueeze(-1).expand(-1, -1, x.size(-1))
        h = self.inp(torch.cat([x, e], dim=1))
        h = self.blocks(h)
        return self.head(h[:, :, -1])

    def training_step(self, batch, batch_idx):
        x, y, sid = batch
        pred = self(x, sid)
        loss = F.l1_loss(pred, y)
        self.log("train/mae", loss, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def on_validation_epoch_start(self):
        self._t0 = time.time()

    def validation_step(self, batch, batch_idx):
        x, y, sid = batch
        pred = self(x, sid)
        self._val_abs.append((pred - y).abs().mean().detach())
        self._val_sq.append(((pred - y) ** 2).mean().detach())

    def on_validation_epoch_end(self):
        mae = torch.stack(self._val_abs).mean()
        rmse = torch.stack(self._val_sq).mean().sqrt()
        self._val_abs.clear()
        self._val_sq.clear()
        if self.trainer.is_global_zero:
            self.log("val/mae", mae, sync_dist=True)
            self.log("val/rmse", rmse, sync_dist=True)
            print(f"[epoch {self.current_epoch}] val mae={mae.item():.4f} rmse={rmse.item():.4f} "
                  f"({time.time() - self._t0:.1f}s)")

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.trainer.max_epochs)
        return [opt], [sched]


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/LD2011_2014.parquet")
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--bs", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--logdir", default="tb_logs")
    return ap.parse_args()


if __name__ == "__main__":
    args = get_args()
    pl.seed_everything(2024)
    torch.set_float32_matmul_precision("high")
    dm = ElectricityDM(args.data, batch_size=args.bs)
    model = TCNForecaster(lr=args.lr)
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=args.gpus,
        strategy="ddp",
        precision="bf16-mixed",
        max_epochs=args.epochs,
        logger=TensorBoardLogger(args.logdir, name="tcn_electricity"),
        callbacks=[ModelCheckpoint(monitor="val/mae", mode="min", save_last=True),
                   RichProgressBar()],
        gradient_clip_val=1.0,
    )
    trainer.fit(model, dm)
