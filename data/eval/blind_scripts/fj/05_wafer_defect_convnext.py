#!/usr/bin/env python
# Wafer-map defect classification (ConvNeXt-T) for the fab analytics engagement.
#
#   torchrun --standalone --nproc_per_node=4 05_wafer_defect_convnext.py \
#       --train-csv data/wafer/train.csv --val-csv data/wafer/val.csv --img-dir data/wafer/img
import argparse
import logging
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

log = logging.getLogger("wafer")

CLASSES = ["none", "center", "donut", "edge-loc", "edge-ring", "loc", "near-full", "random", "scratch"]


class WaferDataset(Dataset):
    def __init__(self, csv_path, img_dir, transform):
        self.df = pd.read_csv(csv_path)
        self.img_dir = Path(img_dir)
        self.transform = transform
        self.targets = self.df["failure_type"].map({c: i for i, c in enumerate(CLASSES)}).values

    def __len__(self):
        return len(self.df)

    def __getitem__(self, idx):
        img = Image.open(self.img_dir / self.df.iloc[idx]["file"]).convert("RGB")
        return self.transform(img), int(self.targets[idx])


# ---------------------------------------------------------------- callbacks
class Callback:
    def on_train_start(self, trainer): pass
    def on_train_batch_end(self, trainer, batch_idx, loss): pass
    def on_validation_end(self, trainer, metrics): pass
    def on_train_end(self, trainer): pass


class EarlyStopping(Callback):
    def __init__(self, monitor="val_macro_f1", patience=6, mode="max"):
        self.monitor, self.patience, self.mode = monitor, patience, mode
        self.best = -math.inf if mode == "max" else math.inf
        self.wait = 0

    def on_validation_end(self, trainer, metrics):
        if not trainer.is_global_zero:
            return
        current = metrics[self.monitor]
        improved = current > self.best if self.mode == "max" else current < self.best
        if improved:
            self.best, self.wait = current, 0
            return
        self.wait += 1
        if self.wait >= self.patience:
            log.info("no improvement in %s for %d epochs, stopping", self.monitor, self.patience)
            trainer.should_stop = True


class ModelCheckpoint(Callback):
    def __init__(self, dirpath, monitor="val_macro_f1"):
        self.dirpath, self.monitor, self.best = Path(dirpath), monitor, -math.inf

    def on_validation_end(self, trainer, metrics):
        if not trainer.is_global_zero:
            return
        self.dirpath.mkdir(parents=True, exist_ok=True)
        state = {"model": trainer.model.module.state_dict(), "epoch": trainer.current_epoch,
                 "metrics": metrics, "classes": CLASSES}
        torch.save(state, self.dirpath / "last.pt")
        if metrics[self.monitor] > self.best:
            self.best = metrics[self.monitor]
            torch.save(state, self.dirpath / "best.pt")


class LearningRateMonitor(Callback):
    def on_train_batch_end(self, trainer, batch_idx, loss):
        if trainer.is_global_zero and batch_idx % 100 == 0:
            lr = trainer.optimizer.param_groups[0]["lr"]
            log.info("epoch %d step %d loss %.4f lr %.2e", trainer.current_epoch, batch_idx, loss, lr)


class Timer(Callback):
    def on_train_start(self, trainer):
        self.t0 = time.time()

    def on_train_end(self, trainer):
        if trainer.is_global_zero:
            log.info("training took %.1f min", (time.time() - self.t0) / 60)


# ---------------------------------------------------------------- trainer
class Trainer:
    def __init__(self, model, optimizer, scheduler, local_rank, max_epochs, callbacks,
                 class_weights=None, clip_val=1.0):
        self.device = torch.device("cuda", local_rank)
        self.model = DDP(model.to(self.device), device_ids=[local_rank])
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.max_epochs = max_epochs
        self.callbacks = callbacks
        self.clip_val = clip_val
        self.class_weights = class_weights.to(self.device) if class_weights is not None else None
        self.is_global_zero = dist.get_rank() == 0
        self.current_epoch = 0
        self.should_stop = False

    def call(self, hook, *args):
        for cb in self.callbacks:
            getattr(cb, hook)(self, *args)

    def training_epoch(self, loader):
        self.model.train()
        for batch_idx, (x, y) in enumerate(loader):
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = self.model(x)
            loss = F.cross_entropy(logits.float(), y, weight=self.class_weights)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_val)
            self.optimizer.step()
            self.scheduler.step()
            self.call("on_train_batch_end", batch_idx, loss.item())

    @torch.no_grad()
    def validation_epoch(self, loader):
        net = self.model.module
        net.eval()
        n_cls = len(CLASSES)
        confusion = torch.zeros(n_cls, n_cls, dtype=torch.long, device=self.device)
        for x, y in loader:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = net(x).argmax(1)
            confusion += torch.bincount(y * n_cls + pred, minlength=n_cls * n_cls).view(n_cls, n_cls)
        dist.all_reduce(confusion)
        tp = confusion.diag().double()
        precision = tp / confusion.sum(0).clamp(min=1)
        recall = tp / confusion.sum(1).clamp(min=1)
        f1 = 2 * precision * recall / (precision + recall).clamp(min=1e-12)
        return {"val_acc": (tp.sum() / confusion.sum()).item(), "val_macro_f1": f1.mean().item()}

    def fit(self, train_loader, val_loader):
        self.call("on_train_start")
        for epoch in range(self.max_epochs):
            self.current_epoch = epoch
            train_loader.sampler.set_epoch(epoch)
            self.training_epoch(train_loader)
            metrics = self.validation_epoch(val_loader)
            if self.is_global_zero:
                log.info("epoch %d  acc %.4f  macro-F1 %.4f", epoch, metrics["val_acc"], metrics["val_macro_f1"])
            self.call("on_validation_end", metrics)
            if self.should_stop:
                break
        self.call("on_train_end")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-csv", required=True)
    ap.add_argument("--val-csv", required=True)
    ap.add_argument("--img-dir", required=True)
    ap.add_argument("--model", default="convnext_tiny.fb_in22k")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--patience", type=int, default=6)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--out", default="checkpoints/wafer")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(stream=sys.stdout, level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")

    tf_train = transforms.Compose([transforms.Resize((224, 224)), transforms.RandomHorizontalFlip(),
                                   transforms.RandomVerticalFlip(), transforms.RandomRotation(180),
                                   transforms.ToTensor()])
    tf_val = transforms.Compose([transforms.Resize((224, 224)), transforms.ToTensor()])
    train_ds = WaferDataset(args.train_csv, args.img_dir, tf_train)
    val_ds = WaferDataset(args.val_csv, args.img_dir, tf_val)

    counts = np.bincount(train_ds.targets, minlength=len(CLASSES)).astype(np.float64)
    class_weights = torch.tensor((counts.sum() / (len(CLASSES) * np.maximum(counts, 1))) ** 0.5,
                                 dtype=torch.float32)

    train_loader = DataLoader(train_ds, batch_size=args.batch_size,
                              sampler=DistributedSampler(train_ds, shuffle=True, drop_last=True),
                              num_workers=args.workers, pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)),
                            batch_size=args.batch_size * 2, num_workers=args.workers, pin_memory=True)

    model = timm.create_model(args.model, pretrained=True, num_classes=len(CLASSES))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr,
                                                    total_steps=args.epochs * len(train_loader),
                                                    pct_start=0.05)
    callbacks = [LearningRateMonitor(), ModelCheckpoint(args.out), EarlyStopping(patience=args.patience), Timer()]
    trainer = Trainer(model, optimizer, scheduler, local_rank, args.epochs, callbacks, class_weights)
    trainer.fit(train_loader, val_loader)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
