#!/usr/bin/env python
"""
DenseNet-121 baseline on CheXpert (frontal views, 5 competition tasks).

Usage:
    torchrun --nproc_per_node=4 01_chexpert_densenet_ddp.py \
        --data-root /data/chexpert/CheXpert-v1.0-small --out-dir runs/dn121_u1
"""
import argparse
import json
import logging
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torchvision import models, transforms

TASKS = ["Atelectasis", "Cardiomegaly", "Consolidation", "Edema", "Pleural Effusion"]

logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", level=logging.INFO)
log = logging.getLogger("chexpert")


def parse_args():
    p = argparse.ArgumentParser(description="CheXpert DenseNet-121")
    p.add_argument("--data-root", required=True, help="folder that holds train.csv / valid.csv")
    p.add_argument("--out-dir", default="runs/chexpert_dn121")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=1e-5)
    p.add_argument("--img-size", type=int, default=320)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--uncertain", choices=["ones", "zeros", "ignore"], default="ones")
    p.add_argument("--amp", action="store_true")
    p.add_argument("--log-every", type=int, default=100)
    return p.parse_args()


class CheXpertFrontal(Dataset):
    """Frontal-view CheXpert images with the U-Ones / U-Zeros policy applied."""

    def __init__(self, root, csv_name, transform, uncertain="ones"):
        df = pd.read_csv(os.path.join(root, csv_name))
        df = df[df["Frontal/Lateral"] == "Frontal"].reset_index(drop=True)
        labels = df[TASKS].fillna(0.0).values.astype(np.float32)
        mask = np.ones_like(labels)
        if uncertain == "ones":
            labels[labels == -1] = 1.0
        elif uncertain == "zeros":
            labels[labels == -1] = 0.0
        else:
            mask[labels == -1] = 0.0
            labels[labels == -1] = 0.0
        self.paths = df["Path"].tolist()
        self.labels = labels
        self.mask = mask
        # paths in the csv start with "CheXpert-v1.0-small/..."
        self.prefix = os.path.dirname(root.rstrip("/"))
        self.transform = transform

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.prefix, self.paths[i])).convert("RGB")
        return self.transform(img), torch.from_numpy(self.labels[i]), torch.from_numpy(self.mask[i])


def build_transforms(size):
    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([
        transforms.Resize((size, size)),
        transforms.RandomAffine(degrees=10, translate=(0.05, 0.05), scale=(0.95, 1.05)),
        transforms.ToTensor(),
        norm,
    ])
    eval_tf = transforms.Compose([transforms.Resize((size, size)), transforms.ToTensor(), norm])
    return train_tf, eval_tf


def build_model(num_classes):
    net = models.densenet121(weights=models.DenseNet121_Weights.IMAGENET1K_V1)
    net.classifier = nn.Linear(net.classifier.in_features, num_classes)
    return net


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    probs, gts = [], []
    for images, labels, _ in loader:
        logits = net(images.to(device, non_blocking=True))
        probs.append(torch.sigmoid(logits.float()).cpu())
        gts.append(labels)
    probs = torch.cat(probs).numpy()
    gts = torch.cat(gts).numpy()
    aucs = {}
    for j, name in enumerate(TASKS):
        if len(np.unique(gts[:, j])) > 1:
            aucs[name] = float(roc_auc_score(gts[:, j], probs[:, j]))
    net.train()
    return aucs


def main():
    args = parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    if is_main:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)
        log.info("world size %d, %d images per step", world_size, world_size * args.batch_size)

    train_tf, eval_tf = build_transforms(args.img_size)
    train_ds = CheXpertFrontal(args.data_root, "train.csv", train_tf, args.uncertain)
    valid_ds = CheXpertFrontal(args.data_root, "valid.csv", eval_tf, "zeros")

    train_loader = DataLoader(
        train_ds,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        pin_memory=True,
        drop_last=True,
        persistent_workers=True,
    )
    valid_loader = DataLoader(valid_ds, batch_size=64, shuffle=False, num_workers=4, pin_memory=True)

    model = build_model(len(TASKS))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    criterion = nn.BCEWithLogitsLoss(reduction="none")
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999),
                                 weight_decay=args.weight_decay)
    steps_per_epoch = len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.lr, total_steps=args.epochs * steps_per_epoch, pct_start=0.1)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    best_mean_auc = 0.0
    global_step = 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        running = 0.0
        for images, labels, mask in train_loader:
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            mask = mask.to(device, non_blocking=True)

            with torch.cuda.amp.autocast(enabled=args.amp):
                logits = model(images)
                loss = (criterion(logits.float(), labels) * mask).sum() / mask.sum().clamp(min=1.0)

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()

            running += loss.item()
            global_step += 1
            if is_main and global_step % args.log_every == 0:
                log.info("epoch %d step %d loss %.4f lr %.2e (%.1fs)", epoch, global_step,
                         running / args.log_every, scheduler.get_last_lr()[0], time.time() - t0)
                running = 0.0

        # the official validation set is tiny (~200 frontal images), one GPU is enough
        if is_main:
            aucs = evaluate(model.module, valid_loader, device)
            mean_auc = float(np.mean(list(aucs.values())))
            log.info("epoch %d valid AUC %s mean %.4f", epoch,
                     {k: round(v, 4) for k, v in aucs.items()}, mean_auc)
            state = {
                "epoch": epoch,
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "auc": aucs,
            }
            torch.save(state, os.path.join(args.out_dir, "last.pt"))
            if mean_auc > best_mean_auc:
                best_mean_auc = mean_auc
                torch.save(state, os.path.join(args.out_dir, "best.pt"))
                log.info("new best mean AUC %.4f", best_mean_auc)
        dist.barrier()

    if is_main:
        log.info("done, best mean AUC %.4f", best_mean_auc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
