"""DeepLabV3-ResNet50 semantic segmentation on Cityscapes with PyTorch Lightning.

    python 06_cityscapes_seg.py --data_root /datasets/cityscapes --gpus 4 --batch_size 2
"""
import argparse
import os

import numpy as np
import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchmetrics.classification import MulticlassJaccardIndex
from torchvision.models.segmentation import deeplabv3_resnet50
import torchvision.transforms.v2 as T
from torchvision import tv_tensors

IGNORE_INDEX = 255
# Cityscapes labelIds -> trainIds (19 classes)
ID_TO_TRAINID = {7: 0, 8: 1, 11: 2, 12: 3, 13: 4, 17: 5, 19: 6, 20: 7, 21: 8, 22: 9, 23: 10,
                 24: 11, 25: 12, 26: 13, 27: 14, 28: 15, 31: 16, 32: 17, 33: 18}


class CityscapesSeg(Dataset):
    def __init__(self, root, split="train", crop=(768, 768)):
        self.img_dir = os.path.join(root, "leftImg8bit", split)
        self.lbl_dir = os.path.join(root, "gtFine", split)
        self.samples = []
        for city in sorted(os.listdir(self.img_dir)):
            for name in sorted(os.listdir(os.path.join(self.img_dir, city))):
                lbl = name.replace("leftImg8bit", "gtFine_labelIds")
                self.samples.append((os.path.join(self.img_dir, city, name),
                                     os.path.join(self.lbl_dir, city, lbl)))
        self.lut = np.full(256, IGNORE_INDEX, dtype=np.uint8)
        for k, v in ID_TO_TRAINID.items():
            self.lut[k] = v
        if split == "train":
            self.tf = T.Compose([
                T.RandomResize(512, 2048),
                T.RandomCrop(crop, pad_if_needed=True, fill={tv_tensors.Mask: IGNORE_INDEX, "others": 0}),
                T.RandomHorizontalFlip(),
                T.ColorJitter(0.3, 0.3, 0.3),
                T.ToDtype(torch.float32, scale=True),
                T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
            ])
        else:
            self.tf = T.Compose([
                T.ToDtype(torch.float32, scale=True),
                T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
            ])

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        img_path, lbl_path = self.samples[idx]
        img = tv_tensors.Image(torch.from_numpy(np.array(Image.open(img_path).convert("RGB"))).permute(2, 0, 1))
        lbl = self.lut[np.array(Image.open(lbl_path))]
        mask = tv_tensors.Mask(torch.from_numpy(lbl).long())
        img, mask = self.tf(img, mask)
        return img, mask


class SegModule(L.LightningModule):
    def __init__(self, num_classes=19, lr=0.01, weight_decay=1e-4, max_epochs=200):
        super().__init__()
        self.save_hyperparameters()
        self.net = deeplabv3_resnet50(weights=None, weights_backbone="IMAGENET1K_V2",
                                      num_classes=num_classes, aux_loss=True)
        self.val_miou = MulticlassJaccardIndex(num_classes=num_classes, ignore_index=IGNORE_INDEX)

    def forward(self, x):
        return self.net(x)["out"]

    def training_step(self, batch, batch_idx):
        img, mask = batch
        out = self.net(img)
        loss = F.cross_entropy(out["out"], mask, ignore_index=IGNORE_INDEX)
        loss = loss + 0.4 * F.cross_entropy(out["aux"], mask, ignore_index=IGNORE_INDEX)
        self.log("train/loss", loss, on_step=True, on_epoch=True, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        img, mask = batch
        logits = self(img)
        loss = F.cross_entropy(logits, mask, ignore_index=IGNORE_INDEX)
        preds = logits.argmax(dim=1)
        self.val_miou.update(preds, mask)
        self.log("val/loss", loss, on_epoch=True, sync_dist=True)

    def on_validation_epoch_end(self):
        self.log("val/mIoU", self.val_miou.compute(), prog_bar=True)
        self.val_miou.reset()

    def configure_optimizers(self):
        params = [
            {"params": self.net.backbone.parameters(), "lr": self.hparams.lr},
            {"params": self.net.classifier.parameters(), "lr": self.hparams.lr * 10},
            {"params": self.net.aux_classifier.parameters(), "lr": self.hparams.lr * 10},
        ]
        opt = torch.optim.SGD(params, lr=self.hparams.lr, momentum=0.9,
                              weight_decay=self.hparams.weight_decay)
        total = self.trainer.estimated_stepping_batches
        sched = torch.optim.lr_scheduler.PolynomialLR(opt, total_iters=total, power=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data_root", required=True)
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--batch_size", type=int, default=2, help="per GPU")
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--out", default="runs/deeplab_cityscapes")
    args = parser.parse_args()

    L.seed_everything(42, workers=True)
    train_ds = CityscapesSeg(args.data_root, "train")
    val_ds = CityscapesSeg(args.data_root, "val")
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True,
                          num_workers=args.workers, pin_memory=True, drop_last=True,
                          persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=1, shuffle=False, num_workers=args.workers,
                        pin_memory=True)

    model = SegModule(lr=args.lr, max_epochs=args.epochs)

    trainer = L.Trainer(
        accelerator="gpu",
        devices=args.gpus,
        strategy="ddp",
        precision="16-mixed",
        max_epochs=args.epochs,
        check_val_every_n_epoch=5,
        logger=TensorBoardLogger(args.out, name="tb"),
        callbacks=[
            ModelCheckpoint(dirpath=os.path.join(args.out, "ckpt"), monitor="val/mIoU",
                            mode="max", save_top_k=2, save_last=True),
            LearningRateMonitor(logging_interval="step"),
        ],
        log_every_n_steps=20,
    )
    trainer.fit(model, train_dl, val_dl)


if __name__ == "__main__":
    main()
