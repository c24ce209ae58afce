"""Train a small UNet for multi-class segmentation of aerial tiles.

PyTorch Lightning 2.x. Data layout:
    <root>/train/images/*.png  <root>/train/masks/*.png
    <root>/val/images/*.png    <root>/val/masks/*.png
Mask pixels hold the class index, 255 = ignore.
"""
import argparse
import glob
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset

import lightning.pytorch as pl
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger

CLASSES = ["background", "building", "road", "water", "tree", "car"]
IGNORE = 255
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


class TileDataset(Dataset):
    def __init__(self, root, split, crop=512, train=True):
        self.images = sorted(glob.glob(os.path.join(root, split, "images", "*.png")))
        self.masks = [p.replace("/images/", "/masks/") for p in self.images]
        self.crop = crop
        self.train = train

    def __len__(self):
        return len(self.images)

    def __getitem__(self, idx):
        img = np.asarray(Image.open(self.images[idx]).convert("RGB"), dtype=np.float32) / 255.0
        mask = np.asarray(Image.open(self.masks[idx]), dtype=np.int64)
        h, w = mask.shape
        if self.train:
            y = np.random.randint(0, max(h - self.crop, 0) + 1)
            x = np.random.randint(0, max(w - self.crop, 0) + 1)
            img = img[y:y + self.crop, x:x + self.crop]
            mask = mask[y:y + self.crop, x:x + self.crop]
            if np.random.rand() < 0.5:
                img = img[:, ::-1]
                mask = mask[:, ::-1]
        img = (img - MEAN) / STD
        img = torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1)))
        mask = torch.from_numpy(np.ascontiguousarray(mask))
        return img, mask


def conv_block(cin, cout):
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False),
        nn.GroupNorm(8, cout),
        nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False),
        nn.GroupNorm(8, cout),
        nn.ReLU(inplace=True),
    )


class UNet(nn.Module):
    def __init__(self, n_classes, base=32):
        super().__init__()
        chs = [base, base * 2, base * 4, base * 8, base * 16]
        self.downs = nn.ModuleList()
        cin = 3
        for c in chs:
            self.downs.append(conv_block(cin, c))
            cin = c
        self.ups = nn.ModuleList()
        self.up_convs = nn.ModuleList()
        for c in reversed(chs[:-1]):
            self.ups.append(nn.ConvTranspose2d(cin, c, 2, stride=2))
            self.up_convs.append(conv_block(c * 2, c))
            cin = c
        self.head = nn.Conv2d(cin, n_classes, 1)

    def forward(self, x):
        skips = []
        for i, down in enumerate(self.downs):
            x = down(x)
            if i < len(self.downs) - 1:
                skips.append(x)
                x = F.max_pool2d(x, 2)
        for up, conv, skip in zip(self.ups, self.up_convs, reversed(skips)):
            x = up(x)
            x = conv(torch.cat([x, skip], dim=1))
        return self.head(x)


class SegModule(pl.LightningModule):
    def __init__(self, n_classes=len(CLASSES), lr=3e-4, weight_decay=1e-4, base=32):
        super().__init__()
        self.save_hyperparameters()
        self.net = UNet(n_classes, base=base)
        self.register_buffer("confmat", torch.zeros(n_classes, n_classes, dtype=torch.long), persistent=False)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        img, mask = batch
        logits = self(img)
        loss = F.cross_entropy(logits, mask, ignore_index=IGNORE)
        self.log("train/loss", loss, on_step=True, on_epoch=True, prog_bar=True, sync_dist=True)
        return loss

    def on_validation_epoch_start(self):
        self.confmat.zero_()

    def validation_step(self, batch, batch_idx):
        img, mask = batch
        logits = self(img)
        loss = F.cross_entropy(logits, mask, ignore_index=IGNORE)
        self.log("val/loss", loss, on_epoch=True, sync_dist=True)
        pred = logits.argmax(1)
        valid = mask != IGNORE
        n = self.hparams.n_classes
        idx = mask[valid] * n + pred[valid]
        self.confmat += torch.bincount(idx, minlength=n * n).reshape(n, n)

    def on_validation_epoch_end(self):
        cm = self.confmat.float()
        inter = cm.diag()
        union = cm.sum(0) + cm.sum(1) - inter
        iou = inter / union.clamp(min=1)
        miou = iou[union > 0].mean()
        self.log("val/miou", miou, prog_bar=True)
        for name, v in zip(CLASSES, iou):
            self.log(f"val_iou/{name}", v)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        sched = torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=self.hparams.lr, total_steps=self.trainer.estimated_stepping_batches, pct_start=0.05
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class TileDataModule(pl.LightningDataModule):
    def __init__(self, root, batch_size=8, num_workers=6, crop=512):
        super().__init__()
        self.root = root
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.crop = crop

    def setup(self, stage=None):
        self.train_ds = TileDataset(self.root, "train", crop=self.crop, train=True)
        self.val_ds = TileDataset(self.root, "val", train=False)

    def train_dataloader(self):
        return DataLoader(self.train_ds, batch_size=self.batch_size, shuffle=True,
                          num_workers=self.num_workers, pin_memory=True, drop_last=True,
                          persistent_workers=True)

    def val_dataloader(self):
        return DataLoader(self.val_ds, batch_size=1, shuffle=False,
                          num_workers=self.num_workers, pin_memory=True)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", default="/data/aerial_tiles")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--num-workers", type=int, default=6)
    p.add_argument("--out", default="runs/unet")
    p.add_argument("--seed", type=int, default=17)
    return p.parse_args()


def main():
    args = parse_args()
    pl.seed_everything(args.seed, workers=True)
    dm = TileDataModule(args.data_root, batch_size=args.batch_size, num_workers=args.num_workers)
    model = SegModule(lr=args.lr)

    ckpt = ModelCheckpoint(dirpath=os.path.join(args.out, "ckpt"), monitor="val/miou", mode="max",
                           save_top_k=3, save_last=True, filename="unet-{epoch:03d}")
    logger = TensorBoardLogger(args.out, name="tb")
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=args.devices,
        strategy="ddp",
        precision="16-mixed",
        max_epochs=args.epochs,
        logger=logger,
        callbacks=[ckpt, LearningRateMonitor("step")],
        log_every_n_steps=20,
        check_val_every_n_epoch=2,
    )
    trainer.fit(model, datamodule=dm)
    if trainer.is_global_zero:
        print(f"best: {ckpt.best_model_path} ({ckpt.best_model_score})")


if __name__ == "__main__":
    main()
