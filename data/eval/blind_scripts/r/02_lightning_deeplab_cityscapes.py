#!/usr/bin/env python
# DeepLabV3-ResNet50 on Cityscapes (fine annotations), Lightning 2.1
# usage: python 02_lightning_deeplab_cityscapes.py --root /datasets/cityscapes --gpus 8
import argparse
import os
import random

import numpy as np
import torch
import torch.nn.functional as F
import torchmetrics
from PIL import Image
from torch.utils.data import DataLoader
from torchvision.datasets import Cityscapes
from torchvision.models.segmentation import deeplabv3_resnet50

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint, LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger

NUM_CLASSES = 19
IGNORE_INDEX = 255
# cityscapes id -> train id
ID_TO_TRAINID = np.full(256, IGNORE_INDEX, dtype=np.uint8)
for c in Cityscapes.classes:
    if 0 <= c.train_id < 255:
        ID_TO_TRAINID[c.id] = c.train_id


class JointTransform:
    def __init__(self, crop=(768, 768), scale=(0.5, 2.0), train=True):
        self.crop = crop
        self.scale = scale
        self.train = train
        self.mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
        self.std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)

    def __call__(self, img, target):
        target = Image.fromarray(ID_TO_TRAINID[np.asarray(target)])
        if self.train:
            s = random.uniform(*self.scale)
            w, h = img.size
            nw, nh = int(w * s), int(h * s)
            img = img.resize((nw, nh), Image.BILINEAR)
            target = target.resize((nw, nh), Image.NEAREST)
            img = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1)
            target = torch.from_numpy(np.asarray(target, dtype=np.int64))
            ch, cw = self.crop
            ph, pw = max(ch - nh, 0), max(cw - nw, 0)
            if ph or pw:
                img = F.pad(img, (0, pw, 0, ph), value=0.0)
                target = F.pad(target, (0, pw, 0, ph), value=IGNORE_INDEX)
            H, W = target.shape
            y, x = random.randint(0, H - ch), random.randint(0, W - cw)
            img, target = img[:, y:y + ch, x:x + cw], target[y:y + ch, x:x + cw]
            if random.random() < 0.5:
                img, target = img.flip(-1), target.flip(-1)
        else:
            img = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1)
            target = torch.from_numpy(np.asarray(target, dtype=np.int64))
        img = (img - self.mean) / self.std
        return img, target


class CityscapesDM(pl.LightningDataModule):
    def __init__(self, root, batch_size, workers):
        super().__init__()
        self.root, self.batch_size, self.workers = root, batch_size, workers

    def setup(self, stage=None):
        self.train_set = Cityscapes(self.root, split="train", mode="fine", target_type="semantic",
                                    transforms=JointTransform(train=True))
        self.val_set = Cityscapes(self.root, split="val", mode="fine", target_type="semantic",
                                  transforms=JointTransform(train=False))

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True,
                          num_workers=self.workers, pin_memory=True, persistent_workers=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=1, num_workers=self.workers, pin_memory=True)


class DeepLab(pl.LightningModule):
    def __init__(self, lr=0.01, momentum=0.9, wd=1e-4, aux_weight=0.4, backbone_ckpt=None):
        super().__init__()
        self.save_hyperparameters()
        self.model = deeplabv3_resnet50(weights=None, weights_backbone=None,
                                        num_classes=NUM_CLASSES, aux_loss=True)
        if backbone_ckpt:
            sd = torch.load(backbone_ckpt, map_location="cpu")
            missing, unexpected = self.model.backbone.load_state_dict(sd, strict=False)
            print(f"backbone: {len(missing)} missing, {len(unexpected)} unexpected")
        self.val_iou = torchmetrics.JaccardIndex(task="multiclass", num_classes=NUM_CLASSES,
                                                 ignore_index=IGNORE_INDEX)

    def forward(self, x):
        return self.model(x)["out"]

    def training_step(self, batch, batch_idx):
        img, target = batch
        out = self.model(img)
        loss = F.cross_entropy(out["out"], target, ignore_index=IGNORE_INDEX)
        aux = F.cross_entropy(out["aux"], target, ignore_index=IGNORE_INDEX)
        total = loss + self.hparams.aux_weight * aux
        self.log("train/loss", total, prog_bar=True, sync_dist=True)
        return total

    def validation_step(self, batch, batch_idx):
        img, target = batch
        logits = self(img)
        self.val_iou.update(logits.argmax(1), target)
        self.log("val/loss", F.cross_entropy(logits, target, ignore_index=IGNORE_INDEX), sync_dist=True)

    def on_validation_epoch_end(self):
        self.log("val/mIoU", self.val_iou.compute(), prog_bar=True)
        self.val_iou.reset()

    def configure_optimizers(self):
        backbone = [p for n, p in self.model.named_parameters() if n.startswith("backbone")]
        heads = [p for n, p in self.model.named_parameters() if not n.startswith("backbone")]
        opt = torch.optim.SGD([
            {"params": backbone, "lr": self.hparams.lr},
            {"params": heads, "lr": self.hparams.lr * 10},
        ], lr=self.hparams.lr, momentum=self.hparams.momentum, weight_decay=self.hparams.wd)
        total = self.trainer.estimated_stepping_batches
        poly = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: (1 - it / total) ** 0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": poly, "interval": "step"}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/datasets/cityscapes")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=2, help="per GPU")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--max-steps", type=int, default=40000)
    ap.add_argument("--backbone-ckpt", default="pretrained/resnet50_imagenet.pth")
    ap.add_argument("--out", default="work_dirs/deeplabv3_r50_cs")
    args = ap.parse_args()

    pl.seed_everything(1234)
    dm = CityscapesDM(args.root, args.batch_size, args.workers)
    model = DeepLab(lr=args.lr, backbone_ckpt=args.backbone_ckpt)

    trainer = pl.Trainer(
        accelerator="gpu",
        devices=args.gpus,
        strategy="ddp",
        precision="16-mixed",
        max_steps=args.max_steps,
        val_check_interval=4000,
        check_val_every_n_epoch=None,
        logger=CSVLogger(args.out),
        callbacks=[
            ModelCheckpoint(dirpath=os.path.join(args.out, "ckpts"), monitor="val/mIoU", mode="max",
                            save_last=True),
            LearningRateMonitor(logging_interval="step"),
        ],
        benchmark=True,
    )
    trainer.fit(model, datamodule=dm)


if __name__ == "__main__":
    main()
