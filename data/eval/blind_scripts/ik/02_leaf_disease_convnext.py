"""Foliar disease classification on UAV plot crops (ConvNeXt-T, timm).

Classes: healthy, yellow_rust, brown_rust, septoria, powdery_mildew, nitrogen_def.
Train/val split is by field (fields listed in the YAML config), so the val score
measures transfer to unseen fields.

    torchrun --standalone --nproc_per_node=8 02_leaf_disease_convnext.py --config configs/disease_cnx.yaml
"""
import argparse
import logging
import os
import time
from pathlib import Path

import albumentations as A
import cv2
import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from albumentations.pytorch import ToTensorV2
from timm.loss import LabelSmoothingCrossEntropy
from timm.scheduler import CosineLRScheduler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

CLASSES = ["healthy", "yellow_rust", "brown_rust", "septoria", "powdery_mildew", "nitrogen_def"]

log = logging.getLogger("disease")


def get_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--opts", nargs="*", default=[], help="key=value overrides")
    a = ap.parse_args()
    with open(a.config) as f:
        cfg = yaml.safe_load(f)
    for kv in a.opts:
        k, v = kv.split("=", 1)
        cfg[k] = yaml.safe_load(v)
    return cfg


def build_transforms(size, train):
    if train:
        return A.Compose([
            A.RandomResizedCrop(size, size, scale=(0.5, 1.0)),
            A.HorizontalFlip(),
            A.VerticalFlip(),
            A.RandomRotate90(),
            A.ShiftScaleRotate(shift_limit=0.05, scale_limit=0.1, rotate_limit=20, p=0.5),
            A.ColorJitter(0.3, 0.3, 0.2, 0.03, p=0.8),
            A.OneOf([A.MotionBlur(blur_limit=5), A.GaussianBlur(blur_limit=(3, 5))], p=0.3),
            A.CoarseDropout(max_holes=6, max_height=size // 8, max_width=size // 8, p=0.3),
            A.Normalize(),
            ToTensorV2(),
        ])
    return A.Compose([A.Resize(size, size), A.Normalize(), ToTensorV2()])


class PlotCrops(Dataset):
    def __init__(self, df, img_dir, tf):
        self.paths = [os.path.join(img_dir, p) for p in df["crop_path"]]
        self.labels = df["label"].map({c: i for i, c in enumerate(CLASSES)}).values
        self.tf = tf

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = cv2.cvtColor(cv2.imread(self.paths[i]), cv2.COLOR_BGR2RGB)
        return self.tf(image=img)["image"], int(self.labels[i])


def setup_logging(rank, out_dir):
    fmt = "%(asctime)s %(levelname)s %(message)s"
    handlers = [logging.StreamHandler()]
    if rank == 0:
        handlers.append(logging.FileHandler(out_dir / "train.log"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format=fmt, handlers=handlers)


@torch.no_grad()
def validate(model, loader, device, num_classes):
    model.eval()
    correct, total = 0, 0
    per_class = np.zeros((num_classes, 2), dtype=np.int64)
    for imgs, labels in loader:
        imgs, labels = imgs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(imgs)
        pred = logits.argmax(1)
        correct += (pred == labels).sum().item()
        total += labels.numel()
        for c in range(num_classes):
            m = labels == c
            per_class[c, 0] += (pred[m] == c).sum().item()
            per_class[c, 1] += m.sum().item()
    acc = correct / max(total, 1)
    recall = per_class[:, 0] / np.maximum(per_class[:, 1], 1)
    return acc, recall.mean()


def main():
    cfg = get_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    out_dir = Path(cfg["out_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    setup_logging(rank, out_dir)
    torch.manual_seed(cfg.get("seed", 0) + rank)

    meta = pd.read_csv(cfg["meta_csv"])
    train_df = meta[meta["field_id"].isin(cfg["train_fields"])].reset_index(drop=True)
    val_df = meta[meta["field_id"].isin(cfg["val_fields"])].reset_index(drop=True)
    log.info("train %d crops / %d fields, val %d crops / %d fields",
             len(train_df), train_df.field_id.nunique(), len(val_df), val_df.field_id.nunique())

    train_ds = PlotCrops(train_df, cfg["img_dir"], build_transforms(cfg["img_size"], True))
    val_ds = PlotCrops(val_df, cfg["img_dir"], build_transforms(cfg["img_size"], False))
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=train_sampler,
                              num_workers=cfg["workers"], pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=cfg["batch_size"] * 2, sampler=val_sampler,
                            num_workers=cfg["workers"], pin_memory=True)

    model = timm.create_model(cfg["arch"], pretrained=True, num_classes=len(CLASSES),
                              drop_path_rate=cfg.get("drop_path", 0.1)).to(device)
    model = DDP(model, device_ids=[local_rank])

    # lr in the config is per 256 images of global batch
    lr = cfg["base_lr"] * cfg["batch_size"] * world_size / 256
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg["weight_decay"])
    steps_per_epoch = len(train_loader)
    scheduler = CosineLRScheduler(optimizer, t_initial=cfg["epochs"] * steps_per_epoch,
                                  warmup_t=cfg["warmup_epochs"] * steps_per_epoch,
                                  warmup_lr_init=1e-6, lr_min=1e-6, t_in_epochs=False)
    criterion = LabelSmoothingCrossEntropy(smoothing=0.1)

    best = 0.0
    step = 0
    for epoch in range(cfg["epochs"]):
        model.train()
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        loss_sum = torch.zeros(1, device=device)
        for imgs, labels in train_loader:
            imgs, labels = imgs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(imgs), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step += 1
            scheduler.step_update(step)
            loss_sum += loss.detach()
        dist.all_reduce(loss_sum)
        train_loss = loss_sum.item() / (world_size * steps_per_epoch)

        acc, mean_recall = validate(model, val_loader, device, len(CLASSES))
        if rank == 0:
            log.info("epoch %d loss %.4f val_acc %.4f val_mrecall %.4f lr %.2e (%.0fs)", epoch, train_loss,
                     acc, mean_recall, optimizer.param_groups[0]["lr"], time.time() - t0)
            state = {"model": model.module.state_dict(), "epoch": epoch, "val_mrecall": mean_recall, "cfg": cfg}
            torch.save(state, out_dir / "last.pth")
            if mean_recall > best:
                best = mean_recall
                torch.save(state, out_dir / "best.pth")
                log.info("new best mean recall %.4f", best)
        dist.barrier()

    if rank == 0:
        log.info("done, best val mean recall %.4f", best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
