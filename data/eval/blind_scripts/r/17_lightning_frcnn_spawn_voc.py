"""Faster R-CNN (MobileNetV3-FPN) for PPE detection (helmet / vest / person), VOC xml labels.

    python 17_lightning_frcnn_spawn_voc.py --root /data/ppe_voc --gpus 4
"""
import argparse
import os
import xml.etree.ElementTree as ET

import torch
import torchvision
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchmetrics.detection import MeanAveragePrecision
from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_fpn
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor
from torchvision.transforms import v2 as T
from torchvision import tv_tensors

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

CLASSES = ["__background__", "helmet", "vest", "person"]


class VOCDet(Dataset):
    def __init__(self, root, split, transforms):
        with open(os.path.join(root, "ImageSets", "Main", f"{split}.txt")) as f:
            self.ids = [l.strip() for l in f if l.strip()]
        self.root, self.transforms = root, transforms

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        iid = self.ids[i]
        img = Image.open(os.path.join(self.root, "JPEGImages", iid + ".jpg")).convert("RGB")
        tree = ET.parse(os.path.join(self.root, "Annotations", iid + ".xml"))
        boxes, labels = [], []
        for obj in tree.findall("object"):
            name = obj.find("name").text.strip().lower()
            if name not in CLASSES:
                continue
            bb = obj.find("bndbox")
            boxes.append([float(bb.find(k).text) for k in ("xmin", "ymin", "xmax", "ymax")])
            labels.append(CLASSES.index(name))
        target = {
            "boxes": tv_tensors.BoundingBoxes(torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
                                              format="XYXY", canvas_size=(img.height, img.width)),
            "labels": torch.tensor(labels, dtype=torch.int64),
        }
        img = tv_tensors.Image(T.functional.pil_to_tensor(img))
        img, target = self.transforms(img, target)
        return img, target


class PPEData(pl.LightningDataModule):
    def __init__(self, root, batch_size=8, workers=4):
        super().__init__()
        self.root, self.batch_size, self.workers = root, batch_size, workers
        self.train_tf = T.Compose([T.RandomPhotometricDistort(), T.RandomZoomOut(fill=114, side_range=(1.0, 2.0)),
                                   T.RandomIoUCrop(), T.RandomHorizontalFlip(), T.ToDtype(torch.float32, scale=True),
                                   T.SanitizeBoundingBoxes()])
        self.val_tf = T.Compose([T.ToDtype(torch.float32, scale=True)])
        self.collate_fn = lambda batch: tuple(zip(*batch))

    def setup(self, stage=None):
        self.train_set = VOCDet(self.root, "train", self.train_tf)
        self.val_set = VOCDet(self.root, "val", self.val_tf)

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.workers,
                          collate_fn=self.collate_fn, drop_last=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=4, num_workers=self.workers, collate_fn=self.collate_fn)


class Detector(pl.LightningModule):
    def __init__(self, lr=0.02, epochs=26):
        super().__init__()
        self.save_hyperparameters()
        self.model = fasterrcnn_mobilenet_v3_large_fpn(weights=None, weights_backbone=None,
                                                       trainable_backbone_layers=6)
        in_features = self.model.roi_heads.box_predictor.cls_score.in_features
        self.model.roi_heads.box_predictor = FastRCNNPredictor(in_features, len(CLASSES))
        self.map = MeanAveragePrecision(iou_type="bbox")

    def training_step(self, batch, batch_idx):
        images, targets = batch
        losses = self.model(list(images), [dict(t) for t in targets])
        loss = sum(losses.values())
        self.log_dict({f"train/{k}": v for k, v in losses.items()}, sync_dist=True, batch_size=len(images))
        self.log("train/loss", loss, prog_bar=True, sync_dist=True, batch_size=len(images))
        return loss

    def validation_step(self, batch, batch_idx):
        images, targets = batch
        preds = self.model(list(images))
        self.map.update(preds, [{"boxes": t["boxes"].as_subclass(torch.Tensor), "labels": t["labels"]} for t in targets])

    def on_validation_epoch_end(self):
        res = self.map.compute()
        self.log("val/mAP", res["map"], prog_bar=True)
        self.log("val/mAP50", res["map_50"])
        self.map.reset()

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=self.hparams.lr, momentum=0.9, weight_decay=4e-5)
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[16, 22], gamma=0.1)
        return [opt], [sched]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/ppe_voc")
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=26)
    ap.add_argument("--lr", type=float, default=0.02)
    args = ap.parse_args()

    pl.seed_everything(0)
    dm = PPEData(args.root, args.batch_size)
    model = Detector(lr=args.lr, epochs=args.epochs)
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=args.gpus,
        strategy="ddp_spawn",
        max_epochs=args.epochs,
        callbacks=[ModelCheckpoint(monitor="val/mAP", mode="max", save_last=True)],
        default_root_dir="runs/ppe_frcnn",
    )
    trainer.fit(model, datamodule=dm)


if __name__ == "__main__":
    main()
