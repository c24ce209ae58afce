"""
Sentinel-2 land-cover segmentation with PyTorch Lightning.

Chips are 13-band L1C GeoTIFFs (256x256) with a single-band label raster.
Per-band statistics come from a precomputed json (tools/band_stats.py).

    python train_s2_landcover.py --data /mnt/shared/s2_chips --devices 4 --batch-size 16
"""
import argparse
import json
import os
from pathlib import Path

import numpy as np
import rasterio
import torch
import torch.nn as nn
import torch.nn.functional as F
import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint, LearningRateMonitor
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset
from torchmetrics.classification import MulticlassJaccardIndex, MulticlassF1Score
import segmentation_models_pytorch as smp

NUM_CLASSES = 10
IGNORE = 0  # label 0 is unlabeled / no-data in this product


class S2ChipDataset(Dataset):
    def __init__(self, root, split, band_stats, bands, augment=False):
        root = Path(root)
        with open(root / f"{split}.txt") as f:
            self.ids = [line.strip() for line in f if line.strip()]
        self.img_dir = root / "images"
        self.lbl_dir = root / "labels"
        self.bands = bands
        self.mean = np.array([band_stats["mean"][b - 1] for b in bands], dtype=np.float32)[:, None, None]
        self.std = np.array([band_stats["std"][b - 1] for b in bands], dtype=np.float32)[:, None, None]
        self.augment = augment

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        cid = self.ids[i]
        with rasterio.open(self.img_dir / f"{cid}.tif") as src:
            x = src.read(self.bands).astype(np.float32)
            nodata = src.nodata
        with rasterio.open(self.lbl_dir / f"{cid}.tif") as src:
            y = src.read(1).astype(np.int64)
        if nodata is not None:
            y[(x == nodata).all(0)] = IGNORE
        x = (x - self.mean) / self.std
        if self.augment:
            k = np.random.randint(4)
            x, y = np.rot90(x, k, axes=(1, 2)), np.rot90(y, k)
            if np.random.rand() < 0.5:
                x, y = x[:, :, ::-1], y[:, ::-1]
        return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(y))


class S2DataModule(L.LightningDataModule):
    def __init__(self, root, bands, batch_size, num_workers):
        super().__init__()
        self.root = root
        self.bands = bands
        self.batch_size = batch_size
        self.num_workers = num_workers

    def setup(self, stage=None):
        with open(Path(self.root) / "band_stats.json") as f:
            stats = json.load(f)
        self.train_ds = S2ChipDataset(self.root, "train", stats, self.bands, augment=True)
        self.val_ds = S2ChipDataset(self.root, "val", stats, self.bands)

    # Lightning injects a DistributedSampler for these under the ddp strategy
    def train_dataloader(self):
        return DataLoader(self.train_ds, batch_size=self.batch_size, shuffle=True,
                          num_workers=self.num_workers, pin_memory=True, drop_last=True,
                          persistent_workers=self.num_workers > 0)

    def val_dataloader(self):
        return DataLoader(self.val_ds, batch_size=self.batch_size, shuffle=False,
                          num_workers=self.num_workers, pin_memory=True)


class LandCoverModule(L.LightningModule):
    def __init__(self, in_channels, lr=3e-4, weight_decay=1e-4, encoder="efficientnet-b2", epochs=80):
        super().__init__()
        self.save_hyperparameters()
        self.net = smp.Unet(encoder_name=encoder, encoder_weights=None,
                            in_channels=in_channels, classes=NUM_CLASSES)
        self.loss = nn.CrossEntropyLoss(ignore_index=IGNORE)
        # torchmetrics syncs its states across processes in compute()
        self.val_iou = MulticlassJaccardIndex(NUM_CLASSES, ignore_index=IGNORE, average="none")
        self.val_f1 = MulticlassF1Score(NUM_CLASSES, ignore_index=IGNORE, average="macro")

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = self.loss(logits, y)
        self.log("train/loss", loss, on_step=True, on_epoch=True, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = self.loss(logits, y)
        preds = logits.argmax(1)
        self.val_iou.update(preds, y)
        self.val_f1.update(preds, y)
        self.log("val/loss", loss, on_epoch=True, sync_dist=True)

    def on_validation_epoch_end(self):
        per_class = self.val_iou.compute()
        valid = torch.arange(NUM_CLASSES, device=per_class.device) != IGNORE
        miou = per_class[valid].mean()
        self.log("val/mIoU", miou, prog_bar=True)
        self.log("val/F1", self.val_f1.compute())
        for c in range(1, NUM_CLASSES):
            self.log(f"val_iou/class_{c}", per_class[c])
        self.val_iou.reset()
        self.val_f1.reset()

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr,
                                weight_decay=self.hparams.weight_decay)
        sched = torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=self.hparams.lr,
            total_steps=self.trainer.estimated_stepping_batches, pct_start=0.05)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--bands", type=int, nargs="+", default=[2, 3, 4, 5, 6, 7, 8, 9, 12, 13])
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--encoder", default="efficientnet-b2")
    p.add_argument("--out", default="/mnt/shared/experiments/s2_landcover")
    p.add_argument("--resume", default=None)
    return p.parse_args()


def main():
    args = parse_args()
    L.seed_everything(1234, workers=True)

    dm = S2DataModule(args.data, args.bands, args.batch_size, args.workers)
    model = LandCoverModule(in_channels=len(args.bands), lr=args.lr,
                            encoder=args.encoder, epochs=args.epochs)

    ckpt_cb = ModelCheckpoint(dirpath=os.path.join(args.out, "checkpoints"),
                              filename="{epoch:03d}-{val/mIoU:.4f}", monitor="val/mIoU",
                              mode="max", save_top_k=3, save_last=True,
                              auto_insert_metric_name=False)
    logger = TensorBoardLogger(save_dir=args.out, name="tb")

    trainer = L.Trainer(
        accelerator="gpu",
        devices=args.devices,
        num_nodes=args.nodes,
        strategy="ddp",
        sync_batchnorm=True,
        precision="16-mixed",
        max_epochs=args.epochs,
        callbacks=[ckpt_cb, LearningRateMonitor("step")],
        logger=logger,
        log_every_n_steps=25,
        gradient_clip_val=1.0,
    )
    trainer.fit(model, datamodule=dm, ckpt_path=args.resume)
    rank_zero_info(f"best checkpoint: {ckpt_cb.best_model_path} ({ckpt_cb.best_model_score})")


if __name__ == "__main__":
    main()
