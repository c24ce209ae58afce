"""Multi-label chest X-ray classifier (DenseNet-121), 14 findings.

labels CSV columns: Image Index, then one 0/1 column per finding.

    accelerate launch --multi_gpu --num_processes 4 --mixed_precision fp16 13_chest_xray_multilabel.py \
        --images /data/cxr/images --train-csv /data/cxr/train.csv --val-csv /data/cxr/val.csv
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
from accelerate import Accelerator
from accelerate.utils import set_seed
from PIL import Image
from sklearn.metrics import roc_auc_score
from torch.utils.data import DataLoader, Dataset
from torchvision import models, transforms

FINDINGS = [
    "Atelectasis", "Cardiomegaly", "Effusion", "Infiltration", "Mass", "Nodule", "Pneumonia",
    "Pneumothorax", "Consolidation", "Edema", "Emphysema", "Fibrosis", "Pleural_Thickening", "Hernia",
]
DEVICE = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


class CXRDataset(Dataset):
    def __init__(self, csv_path, image_dir, transform):
        df = pd.read_csv(csv_path)
        self.files = df["Image Index"].tolist()
        self.targets = df[FINDINGS].values.astype(np.float32)
        self.image_dir = image_dir
        self.transform = transform

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.image_dir, self.files[i])).convert("RGB")
        return self.transform(img), torch.from_numpy(self.targets[i])


def positive_weights(targets):
    pos = targets.sum(axis=0)
    neg = targets.shape[0] - pos
    return torch.tensor(neg / np.clip(pos, 1, None), dtype=torch.float32)


def build_model(num_classes, dropout):
    net = models.densenet121(weights=models.DenseNet121_Weights.IMAGENET1K_V1)
    net.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(net.classifier.in_features, num_classes))
    return net


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", required=True)
    ap.add_argument("--train-csv", required=True)
    ap.add_argument("--val-csv", required=True)
    ap.add_argument("--out", default="runs/cxr_densenet")
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--dropout", type=float, default=0.2)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=99)
    return ap.parse_args()


def main():
    args = parse_args()
    accelerator = Accelerator()
    set_seed(args.seed)

    normalize = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([
        transforms.Resize(256),
        transforms.RandomResizedCrop(224, scale=(0.85, 1.0)),
        transforms.RandomRotation(7),
        transforms.ToTensor(),
        normalize,
    ])
    val_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), normalize])
    train_set = CXRDataset(args.train_csv, args.images, train_tf)
    val_set = CXRDataset(args.val_csv, args.images, val_tf)

    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=64, shuffle=False, num_workers=args.workers, pin_memory=True)

    model = build_model(len(FINDINGS), args.dropout)
    pos_weight = positive_weights(train_set.targets).to(DEVICE)
    criterion = nn.BCEWithLogitsLoss(pos_weight=pos_weight)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.1, patience=1)

    model, optimizer, train_loader, val_loader = accelerator.prepare(model, optimizer, train_loader, val_loader)
    if accelerator.is_main_process:
        os.makedirs(args.out, exist_ok=True)
        accelerator.print("pos_weight:", {k: round(float(v), 2) for k, v in zip(FINDINGS, pos_weight)})

    best_auc = 0.0
    for epoch in range(args.epochs):
        model.train()
        tic = time.time()
        running = torch.zeros((), device=accelerator.device)
        for it, (x, y) in enumerate(train_loader):
            logits = model(x)
            loss = criterion(logits, y)
            optimizer.zero_grad(set_to_none=True)
            accelerator.backward(loss)
            optimizer.step()
            running += loss.detach()
            if (it + 1) % 100 == 0:
                mean_loss = accelerator.reduce(running, reduction="mean").item() / 100
                running.zero_()
                accelerator.print(f"epoch {epoch} it {it + 1}/{len(train_loader)} loss {mean_loss:.4f} "
                                  f"({(time.time() - tic) / (it + 1):.2f}s/it)")

        model.eval()
        probs, targets = [], []
        with torch.no_grad():
            for x, y in val_loader:
                p = torch.sigmoid(model(x).float())
                p, y = accelerator.gather_for_metrics((p, y))
                probs.append(p.cpu())
                targets.append(y.cpu())
        probs = torch.cat(probs).numpy()
        targets = torch.cat(targets).numpy()
        aucs = []
        for c in range(len(FINDINGS)):
            if 0 < targets[:, c].sum() < len(targets):
                aucs.append(roc_auc_score(targets[:, c], probs[:, c]))
        mean_auc = float(np.mean(aucs))
        plateau.step(mean_auc)
        accelerator.print(f"epoch {epoch}: mean AUROC {mean_auc:.4f} "
                          f"lr {optimizer.param_groups[0]['lr']:.1e}")

        accelerator.wait_for_everyone()
        if mean_auc > best_auc:
            best_auc = mean_auc
            accelerator.save({"model": accelerator.unwrap_model(model).state_dict(),
                              "epoch": epoch, "auc": mean_auc, "findings": FINDINGS},
                             os.path.join(args.out, "best.pt"))
        accelerator.save_state(os.path.join(args.out, "last_state"))

    accelerator.print(f"best mean AUROC {best_auc:.4f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
