"""Apparent-age regression on face crops (EfficientNet-B2 backbone).

annotations CSV: path,age  (paths relative to --image-root)

    accelerate launch --num_processes 8 --multi_gpu --mixed_precision bf16 06_face_age_regression.py \
        --image-root /data/faces --train-csv /data/faces/train.csv --val-csv /data/faces/val.csv
"""
import argparse
import logging
import os

import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import models, transforms

logger = get_logger(__name__, log_level="INFO")


class FaceAgeDataset(Dataset):
    def __init__(self, csv_file, image_root, transform):
        self.df = pd.read_csv(csv_file)
        self.image_root = image_root
        self.transform = transform

    def __len__(self):
        return len(self.df)

    def __getitem__(self, idx):
        row = self.df.iloc[idx]
        img = Image.open(os.path.join(self.image_root, row["path"])).convert("RGB")
        return self.transform(img), torch.tensor(row["age"], dtype=torch.float32)


class AgeRegressor(nn.Module):
    def __init__(self, age_mean, age_std):
        super().__init__()
        backbone = models.efficientnet_b2(weights=models.EfficientNet_B2_Weights.IMAGENET1K_V1)
        in_features = backbone.classifier[1].in_features
        backbone.classifier = nn.Identity()
        self.backbone = backbone
        self.head = nn.Sequential(nn.Dropout(0.3), nn.Linear(in_features, 1))
        self.register_buffer("age_mean", torch.tensor(age_mean))
        self.register_buffer("age_std", torch.tensor(age_std))

    def forward(self, x):
        z = self.head(self.backbone(x)).squeeze(-1)
        return z * self.age_std + self.age_mean


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--image-root", required=True)
    p.add_argument("--train-csv", required=True)
    p.add_argument("--val-csv", required=True)
    p.add_argument("--output-dir", default="runs/age_effb2")
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--batch-size", type=int, default=48)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--num-workers", type=int, default=8)
    p.add_argument("--seed", type=int, default=2024)
    return p.parse_args()


def main():
    args = parse_args()
    accelerator = Accelerator(log_with="tensorboard", project_dir=args.output_dir)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", level=logging.INFO)
    set_seed(args.seed)

    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(260, scale=(0.8, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.RandomRotation(10),
        transforms.ColorJitter(0.3, 0.3, 0.2),
        transforms.ToTensor(),
        normalize,
    ])
    val_tf = transforms.Compose([transforms.Resize(288), transforms.CenterCrop(260), transforms.ToTensor(), normalize])

    train_set = FaceAgeDataset(args.train_csv, args.image_root, train_tf)
    val_set = FaceAgeDataset(args.val_csv, args.image_root, val_tf)
    age_mean = float(train_set.df["age"].mean())
    age_std = float(train_set.df["age"].std())

    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, shuffle=False,
                            num_workers=args.num_workers, pin_memory=True)

    model = AgeRegressor(age_mean, age_std)
    optimizer = torch.optim.AdamW([
        {"params": model.backbone.parameters(), "lr": args.lr * 0.1},
        {"params": model.head.parameters(), "lr": args.lr},
    ], weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    model, optimizer, train_loader, val_loader = accelerator.prepare(model, optimizer, train_loader, val_loader)
    accelerator.register_for_checkpointing(scheduler)
    accelerator.init_trackers("face_age", config=vars(args))

    best_mae = float("inf")
    global_step = 0
    for epoch in range(args.epochs):
        model.train()
        for step, (images, ages) in enumerate(train_loader):
            preds = model(images)
            loss = F.smooth_l1_loss(preds, ages, beta=2.0)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            global_step += 1
            if step % 100 == 0:
                mean_loss = accelerator.reduce(loss.detach(), reduction="mean")
                accelerator.log({"train/loss": mean_loss.item()}, step=global_step)
                logger.info(f"epoch {epoch} step {step}/{len(train_loader)} loss {mean_loss.item():.3f}")
        scheduler.step()

        model.eval()
        abs_err_sum, sq_err_sum, count = 0.0, 0.0, 0
        with torch.no_grad():
            for images, ages in val_loader:
                preds = model(images)
                err = preds - ages
                abs_err_sum += err.abs().sum().item()
                sq_err_sum += (err ** 2).sum().item()
                count += ages.numel()
        val_mae = abs_err_sum / count
        val_rmse = (sq_err_sum / count) ** 0.5
        logger.info(f"epoch {epoch}: val MAE {val_mae:.3f} RMSE {val_rmse:.3f}")
        accelerator.log({"val/mae": val_mae, "val/rmse": val_rmse, "epoch": epoch}, step=global_step)

        accelerator.save_state(os.path.join(args.output_dir, "last"))
        accelerator.wait_for_everyone()
        if val_mae < best_mae:
            best_mae = val_mae
            accelerator.save(accelerator.unwrap_model(model).state_dict(),
                             os.path.join(args.output_dir, "best_model.pt"))
            logger.info(f"new best MAE {best_mae:.3f}")

    accelerator.end_training()


if __name__ == "__main__":
    main()
