"""Rental listing price regression from listing photo + tabular attributes.

Hydra structured config (no yaml needed), Lightning for the loop.

    python 05_multimodal_listing_hydra.py trainer.devices=4 data.root=/data/listings
"""
import os
from dataclasses import dataclass, field
from typing import List

import hydra
import numpy as np
import pandas as pd
import pytorch_lightning as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from PIL import Image
from pytorch_lightning.callbacks import LearningRateMonitor, ModelCheckpoint
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms as T


@dataclass
class DataCfg:
    root: str = "data/listings"
    csv: str = "listings.csv"
    img_size: int = 224
    batch_size: int = 64
    num_workers: int = 8
    num_cols: List[str] = field(default_factory=lambda: [
        "accommodates", "bedrooms", "beds", "bathrooms", "latitude", "longitude",
        "review_scores_rating", "number_of_reviews", "minimum_nights"])
    cat_cols: List[str] = field(default_factory=lambda: ["room_type", "property_type", "neighbourhood"])


@dataclass
class ModelCfg:
    backbone: str = "resnet34"
    tab_hidden: int = 128
    fused: int = 256
    dropout: float = 0.2
    aux_weight: float = 0.0
    lr: float = 3e-4
    backbone_lr_mult: float = 0.1


@dataclass
class TrainerCfg:
    devices: int = 1
    max_epochs: int = 25
    precision: str = "16-mixed"


@dataclass
class Cfg:
    data: DataCfg = field(default_factory=DataCfg)
    model: ModelCfg = field(default_factory=ModelCfg)
    trainer: TrainerCfg = field(default_factory=TrainerCfg)
    seed: int = 0


cs = ConfigStore.instance()
cs.store(name="config", node=Cfg)


class ListingDataset(Dataset):
    def __init__(self, df, root, num_cols, cat_cols, cat_maps, stats, train):
        self.df = df.reset_index(drop=True)
        self.root = root
        self.num = ((df[num_cols].fillna(stats["median"]) - stats["mean"]) / stats["std"]).values.astype(np.float32)
        self.cat = np.stack([df[c].map(cat_maps[c]).fillna(0).astype(np.int64).values for c in cat_cols], 1)
        self.y = np.log1p(df["price"].values.astype(np.float32))
        norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        if train:
            self.tf = T.Compose([T.RandomResizedCrop(224, scale=(0.6, 1.0)), T.RandomHorizontalFlip(),
                                 T.ColorJitter(0.2, 0.2, 0.2), T.ToTensor(), norm])
        else:
            self.tf = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm])

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.root, "images", f"{self.df.at[i, 'id']}.jpg")).convert("RGB")
        return self.tf(img), torch.from_numpy(self.num[i]), torch.from_numpy(self.cat[i]), self.y[i]


class ListingDM(pl.LightningDataModule):
    def __init__(self, cfg: DataCfg):
        super().__init__()
        self.cfg = cfg
        df = pd.read_csv(os.path.join(cfg.root, cfg.csv))
        df = df[df["price"].between(10, 5000)]
        self.cat_maps = {c: {v: k + 1 for k, v in enumerate(sorted(df[c].dropna().unique()))}
                         for c in cfg.cat_cols}
        self.cat_cards = [len(m) + 1 for m in self.cat_maps.values()]
        self.df = df

    def setup(self, stage=None):
        cfg = self.cfg
        split = self.df["id"].astype(np.int64) % 10
        train_df, val_df = self.df[split < 9], self.df[split >= 9]
        num = train_df[cfg.num_cols]
        stats = {"median": num.median(), "mean": num.fillna(num.median()).mean(),
                 "std": num.fillna(num.median()).std() + 1e-6}
        self.train_ds = ListingDataset(train_df, cfg.root, cfg.num_cols, cfg.cat_cols, self.cat_maps, stats, True)
        self.val_ds = ListingDataset(val_df, cfg.root, cfg.num_cols, cfg.cat_cols, self.cat_maps, stats, False)

    def train_dataloader(self):
        return DataLoader(self.train_ds, batch_size=self.cfg.batch_size, shuffle=True,
                          num_workers=self.cfg.num_workers, pin_memory=True, drop_last=True)

    def val_dataloader(self):
        return DataLoader(self.val_ds, batch_size=self.cfg.batch_size, shuffle=False,
                          num_workers=self.cfg.num_workers, pin_memory=True)


class PriceModel(pl.LightningModule):
    def __init__(self, cfg: ModelCfg, n_num: int, cat_cards: List[int]):
        super().__init__()
        self.save_hyperparameters({"model": OmegaConf.to_container(cfg), "n_num": n_num, "cat_cards": cat_cards})
        self.cfg = cfg
        bb = getattr(torchvision.models, cfg.backbone)(weights="DEFAULT")
        img_dim = bb.fc.in_features
        bb.fc = nn.Identity()
        self.backbone = bb
        self.embs = nn.ModuleList([nn.Embedding(c, min(16, (c + 1) // 2)) for c in cat_cards])
        emb_dim = sum(e.embedding_dim for e in self.embs)
        self.tab = nn.Sequential(nn.Linear(n_num + emb_dim, cfg.tab_hidden), nn.ReLU(),
                                 nn.Linear(cfg.tab_hidden, cfg.tab_hidden), nn.ReLU())
        self.fuse = nn.Sequential(nn.Linear(img_dim + cfg.tab_hidden, cfg.fused), nn.ReLU(),
                                  nn.Dropout(cfg.dropout), nn.Linear(cfg.fused, 1))
        self.img_head = nn.Linear(img_dim, 1)

    def forward(self, img, num, cat):
        f_img = self.backbone(img)
        e = torch.cat([emb(cat[:, j]) for j, emb in enumerate(self.embs)], dim=1)
        f_tab = self.tab(torch.cat([num, e], dim=1))
        return self.fuse(torch.cat([f_img, f_tab], dim=1)).squeeze(-1), f_img

    def _step(self, batch):
        img, num, cat, y = batch
        pred, f_img = self(img, num, cat)
        loss = F.smooth_l1_loss(pred, y)
        if self.cfg.aux_weight > 0:
            aux = self.img_head(f_img).squeeze(-1)
            loss = loss + self.cfg.aux_weight * F.smooth_l1_loss(aux, y)
        return loss, pred, y

    def training_step(self, batch, batch_idx):
        loss, _, _ = self._step(batch)
        self.log("train/loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss, pred, y = self._step(batch)
        mae_dollars = (torch.expm1(pred.float()) - torch.expm1(y.float())).abs().mean()
        self.log("val/loss", loss, on_epoch=True, sync_dist=True)
        self.log("val/mae_usd", mae_dollars, on_epoch=True, sync_dist=True, prog_bar=True)

    def configure_optimizers(self):
        bb_params = list(self.backbone.parameters())
        bb_ids = {id(p) for p in bb_params}
        rest = [p for p in self.parameters() if id(p) not in bb_ids]
        opt = torch.optim.AdamW([
            {"params": bb_params, "lr": self.cfg.lr * self.cfg.backbone_lr_mult},
            {"params": rest, "lr": self.cfg.lr},
        ], weight_decay=1e-4)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.trainer.max_epochs)
        return [opt], [sched]


@hydra.main(version_base=None, config_name="config")
def main(cfg: DictConfig):
    print(OmegaConf.to_yaml(cfg))
    pl.seed_everything(cfg.seed, workers=True)
    dm = ListingDM(cfg.data)
    model = PriceModel(cfg.model, n_num=len(cfg.data.num_cols), cat_cards=dm.cat_cards)
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=cfg.trainer.devices,
        strategy="ddp",
        precision=cfg.trainer.precision,
        max_epochs=cfg.trainer.max_epochs,
        default_root_dir=os.getcwd(),
        callbacks=[ModelCheckpoint(monitor="val/mae_usd", mode="min", save_top_k=3),
                   LearningRateMonitor()],
    )
    trainer.fit(model, datamodule=dm)


if __name__ == "__main__":
    main()
