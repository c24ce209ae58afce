#!/usr/bin/env python
# Chest X-ray triage model (normal / pneumonia / other opacity), DenseNet-121.
#
# The hospital export is a single labelled CSV; we hold out 15% for validation.
#
#   torchrun --standalone --nproc_per_node=4 15_cxr_densenet.py \
#       --csv /data/cxr/labels.csv --img-root /data/cxr/png --epochs 30
import argparse
import logging
import math
import os
import random
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, random_split
from torchvision import models, transforms

log = logging.getLogger("cxr")
LABELS = ["normal", "pneumonia", "other_opacity"]


class CXRDataset(Dataset):
    def __init__(self, csv_path, img_root):
        df = pd.read_csv(csv_path)
        self.paths = [os.path.join(img_root, p) for p in df["image"]]
        self.targets = df["finding"].map({k: i for i, k in enumerate(LABELS)}).astype(int).tolist()
        self.transform = None

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = Image.open(self.paths[i]).convert("L").convert("RGB")
        return img, self.targets[i]


class TransformSubset(Dataset):
    def __init__(self, subset, transform):
        self.subset, self.transform = subset, transform

    def __len__(self):
        return len(self.subset)

    def __getitem__(self, i):
        img, y = self.subset[i]
        return self.transform(img), y


# ------------------------------------------------------------------ callbacks
class Callback:
    def on_fit_start(self, trainer): pass
    def on_epoch_end(self, trainer, logs): pass


class EarlyStopping(Callback):
    def __init__(self, monitor="val_macro_auc", patience=5):
        self.monitor, self.patience, self.best, self.bad = monitor, patience, -1.0, 0

    def on_epoch_end(self, trainer, logs):
        if logs[self.monitor] > self.best + 1e-4:
            self.best, self.bad = logs[self.monitor], 0
        else:
            self.bad += 1
        trainer.should_stop = self.bad >= self.patience


class ModelCheckpoint(Callback):
    def __init__(self, out_dir, monitor="val_macro_auc"):
        self.out_dir, self.monitor, self.best = Path(out_dir), monitor, -1.0

    def on_epoch_end(self, trainer, logs):
        if not trainer.is_main:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if logs[self.monitor] > self.best:
            self.best = logs[self.monitor]
            torch.save({"model": trainer.model.module.state_dict(), "labels": LABELS,
                        "epoch": trainer.epoch, "metrics": logs}, self.out_dir / "best.pt")


class LRMonitor(Callback):
    def on_epoch_end(self, trainer, logs):
        if trainer.is_main:
            log.info("epoch %d | lr %.2e | %s", trainer.epoch, trainer.optimizer.param_groups[0]["lr"],
                     " ".join(f"{k}={v:.4f}" for k, v in logs.items()))


# ------------------------------------------------------------------ trainer
class Trainer:
    def __init__(self, model, optimizer, scheduler, device, callbacks, accum_steps=1, clip_norm=1.0):
        self.device = device
        self.world = dist.get_world_size()
        self.is_main = dist.get_rank() == 0
        self.model = DDP(model.to(device), device_ids=[device.index])
        self.optimizer, self.scheduler = optimizer, scheduler
        self.callbacks, self.accum_steps, self.clip_norm = callbacks, accum_steps, clip_norm
        self.scaler = torch.cuda.amp.GradScaler()
        self.epoch, self.should_stop = 0, False

    def train_epoch(self, loader):
        self.model.train()
        total = torch.zeros(2, device=self.device)
        self.optimizer.zero_grad(set_to_none=True)
        for step, (x, y) in enumerate(loader):
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(self.model(x), y)
            self.scaler.scale(loss / self.accum_steps).backward()
            if (step + 1) % self.accum_steps == 0:
                self.scaler.unscale_(self.optimizer)
                nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_norm)
                self.scaler.step(self.optimizer)
                self.scaler.update()
                self.optimizer.zero_grad(set_to_none=True)
            total += torch.stack([loss.detach().float() * y.size(0), torch.tensor(float(y.size(0)), device=self.device)])
        dist.all_reduce(total)
        return {"train_loss": (total[0] / total[1]).item()}

    @torch.no_grad()
    def evaluate(self, loader):
        net = self.model.module
        net.eval()
        probs, targets = [], []
        for x, y in loader:
            with torch.autocast("cuda", dtype=torch.float16):
                logits = net(x.to(self.device, non_blocking=True))
            probs.append(logits.float().softmax(-1))
            targets.append(y.to(self.device))
        probs, targets = torch.cat(probs), torch.cat(targets)
        # every rank has the same number of val items (DistributedSampler pads), so all_gather works
        p_all = [torch.zeros_like(probs) for _ in range(self.world)]
        t_all = [torch.zeros_like(targets) for _ in range(self.world)]
        dist.all_gather(p_all, probs)
        dist.all_gather(t_all, targets)
        n_val = len(loader.dataset)
        p = torch.stack(p_all, 1).reshape(-1, probs.size(-1))[:n_val].cpu().numpy()
        t = torch.stack(t_all, 1).reshape(-1)[:n_val].cpu().numpy()
        aucs = [roc_auc_score(t == c, p[:, c]) for c in range(len(LABELS))]
        return {"val_acc": float((p.argmax(1) == t).mean()), "val_macro_auc": float(np.mean(aucs))}

    def fit(self, train_loader, val_loader, epochs):
        for cb in self.callbacks:
            cb.on_fit_start(self)
        for epoch in range(epochs):
            self.epoch = epoch
            train_loader.sampler.set_epoch(epoch)
            logs = self.train_epoch(train_loader)
            logs.update(self.evaluate(val_loader))
            self.scheduler.step()
            for cb in self.callbacks:
                cb.on_epoch_end(self, logs)
            if self.should_stop:
                break


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", required=True)
    ap.add_argument("--img-root", required=True)
    ap.add_argument("--val-frac", type=float, default=0.15)
    ap.add_argument("--img-size", type=int, default=320)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--out", default="runs/cxr_densenet121")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")

    # different seed per rank so the random augmentations differ between GPUs
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    full = CXRDataset(args.csv, args.img_root)
    n_val = int(len(full) * args.val_frac)
    train_sub, val_sub = random_split(full, [len(full) - n_val, n_val])

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_ds = TransformSubset(train_sub, transforms.Compose([
        transforms.RandomResizedCrop(args.img_size, scale=(0.7, 1.0)), transforms.RandomRotation(7),
        transforms.ColorJitter(brightness=0.2, contrast=0.2), transforms.ToTensor(), norm]))
    val_ds = TransformSubset(val_sub, transforms.Compose([
        transforms.Resize(args.img_size), transforms.CenterCrop(args.img_size), transforms.ToTensor(), norm]))

    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=DistributedSampler(train_ds, shuffle=True, seed=args.seed),
                              num_workers=8, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=64, num_workers=8, pin_memory=True,
                            sampler=DistributedSampler(val_ds, shuffle=False))

    model = models.densenet121(weights=models.DenseNet121_Weights.IMAGENET1K_V1)
    model.classifier = nn.Linear(model.classifier.in_features, len(LABELS))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs, eta_min=1e-6)

    callbacks = [LRMonitor(), ModelCheckpoint(args.out), EarlyStopping()]
    trainer = Trainer(model, optimizer, scheduler, device, callbacks, accum_steps=args.accum)
    trainer.fit(train_loader, val_loader, args.epochs)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
