"""Daily store-item demand forecasting (28-day horizon) with an N-BEATS style MLP.

Config through Hydra (structured config registered below, override on the CLI),
training through Lightning.  LR schedule: one-cycle, tuned on a single A100.

    python 15_ts_retail_nbeats_hydra.py trainer.devices=8 data.path=/data/m5/sales_long.parquet
"""
import logging
import math
import os
from dataclasses import dataclass, field

import hydra
import numpy as np
import pandas as pd
import pytorch_lightning as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf
from pytorch_lightning.callbacks import LearningRateMonitor, ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

log = logging.getLogger(__name__)


@dataclass
class DataConf:
    path: str = "data/sales_long.parquet"
    lookback: int = 112
    horizon: int = 28
    val_days: int = 28
    batch_size: int = 1024
    num_workers: int = 8
    windows_per_series: int = 16


@dataclass
class OptimConf:
    max_lr: float = 3e-3
    pct_start: float = 0.25
    weight_decay: float = 1e-5


@dataclass
class ModelConf:
    width: int = 512
    blocks: int = 4
    layers_per_block: int = 4


@dataclass
class TrainerConf:
    devices: int = 1
    max_epochs: int = 30
    precision: str = "bf16-mixed"


@dataclass
class Conf:
    data: DataConf = field(default_factory=DataConf)
    optim: OptimConf = field(default_factory=OptimConf)
    model: ModelConf = field(default_factory=ModelConf)
    trainer: TrainerConf = field(default_factory=TrainerConf)
    seed: int = 100


ConfigStore.instance().store(name="base", node=Conf)


class RandomWindows(Dataset):
    """windows_per_series random windows per series per epoch (sampled in __getitem__)."""

    def __init__(self, mat, lookback, horizon, per_series, end):
        self.mat, self.L, self.H, self.k, self.end = mat, lookback, horizon, per_series, end

    def __len__(self):
        return self.mat.shape[0] * self.k

    def __getitem__(self, i):
        s = i // self.k
        t = np.random.randint(self.L, self.end - self.H + 1)
        x = self.mat[s, t - self.L:t]
        y = self.mat[s, t:t + self.H]
        scale = x.mean() + 1.0
        return torch.from_numpy(x / scale), torch.from_numpy(y / scale)


class LastWindow(Dataset):
    def __init__(self, mat, lookback, horizon):
        self.x = mat[:, -(lookback + horizon):-horizon]
        self.y = mat[:, -horizon:]

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        scale = self.x[i].mean() + 1.0
        return torch.from_numpy(self.x[i] / scale), torch.from_numpy(self.y[i] / scale)


class SalesDM(pl.LightningDataModule):
    def __init__(self, cfg: DataConf):
        super().__init__()
        self.cfg = cfg

    def setup(self, stage=None):
        df = pd.read_parquet(self.cfg.path, columns=["id", "d", "sales"])
        mat = df.pivot(index="id", columns="d", values="sales").fillna(0).values.astype(np.float32)
        self.train_ds = RandomWindows(mat, self.cfg.lookback, self.cfg.horizon, self.cfg.windows_per_series,
                                      end=mat.shape[1] - self.cfg.val_days)
        self.val_ds = LastWindow(mat, self.cfg.lookback, self.cfg.horizon)

    def train_dataloader(self):
        return DataLoader(self.train_ds, batch_size=self.cfg.batch_size, shuffle=True,
                          num_workers=self.cfg.num_workers, drop_last=True, pin_memory=True)

    def val_dataloader(self):
        return DataLoader(self.val_ds, batch_size=4096, num_workers=self.cfg.num_workers, pin_memory=True)


class Block(nn.Module):
    def __init__(self, L, H, width, n_layers):
        super().__init__()
        layers, d = [], L
        for _ in range(n_layers):
            layers += [nn.Linear(d, width), nn.ReLU()]
            d = width
        self.fc = nn.Sequential(*layers)
        self.backcast = nn.Linear(width, L)
        self.forecast = nn.Linear(width, H)

    def forward(self, x):
        h = self.fc(x)
        return self.backcast(h), self.forecast(h)


class NBeats(pl.LightningModule):
    def __init__(self, cfg):
        super().__init__()
        self.save_hyperparameters(OmegaConf.to_container(cfg, resolve=True))
        d, m = cfg.data, cfg.model
        self.blocks = nn.ModuleList([Block(d.lookback, d.horizon, m.width, m.layers_per_block)
                                     for _ in range(m.blocks)])
        self.cfg = cfg

    def forward(self, x):
        resid, fc = x, 0.0
        for b in self.blocks:
            back, f = b(resid)
            resid = resid - back
            fc = fc + f
        return fc

    def training_step(self, batch, _):
        x, y = batch
        loss = F.l1_loss(self(x), y)
        self.log("train/mae", loss, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, _):
        x, y = batch
        pred = self(x)
        self.log("val/mae", F.l1_loss(pred, y), sync_dist=True)
        self.log("val/rmse", F.mse_loss(pred, y).sqrt(), sync_dist=True)

    def configure_optimizers(self):
        o, d = self.cfg.optim, self.cfg.data
        opt = torch.optim.AdamW(self.parameters(), lr=o.max_lr, weight_decay=o.weight_decay)
        n_series = len(self.trainer.datamodule.train_ds) // d.windows_per_series
        steps_per_epoch = (n_series * d.windows_per_series) // d.batch_size
        total_steps = steps_per_epoch * self.cfg.trainer.max_epochs
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=o.max_lr, total_steps=total_steps,
                                                    pct_start=o.pct_start, div_factor=25, final_div_factor=1e3)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


@hydra.main(version_base=None, config_name="base")
def main(cfg: Conf):
    log.info("\n" + OmegaConf.to_yaml(cfg))
    pl.seed_everything(cfg.seed, workers=True)
    dm = SalesDM(cfg.data)
    model = NBeats(cfg)
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=cfg.trainer.devices,
        strategy="ddp" if cfg.trainer.devices > 1 else "auto",
        precision=cfg.trainer.precision,
        max_epochs=cfg.trainer.max_epochs,
        gradient_clip_val=1.0,
        callbacks=[ModelCheckpoint(monitor="val/mae", mode="min", save_last=True),
                   LearningRateMonitor(logging_interval="step")],
    )
    trainer.fit(model, datamodule=dm)
    log.info("best: %s (%s)", trainer.checkpoint_callback.best_model_path,
             trainer.checkpoint_callback.best_model_score)


if __name__ == "__main__":
    main()
