#!/usr/bin/env python
"""Retail shelf product recognition - ResNet-50 fine-tuning.

    torchrun --nproc_per_node=4 02_retail_shelf_resnet.py --data /data/shelf --epochs 30

The trainer supports resuming: pass --resume <dir>/last.pt to continue a run
that was pre-empted by the scheduler.
"""
import argparse
import logging
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets, models, transforms
from tqdm import tqdm

logger = logging.getLogger(__name__)


def get_args():
    ap = argparse.ArgumentParser(description="shelf product classifier")
    ap.add_argument("--data", required=True, help="ImageFolder root with train/ and val/")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=64, help="per-GPU batch size")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--wd", type=float, default=1e-4)
    ap.add_argument("--label-smoothing", type=float, default=0.1)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--clip-grad", type=float, default=None)
    ap.add_argument("--amp", action="store_true")
    ap.add_argument("--out", default="runs/shelf_r50")
    ap.add_argument("--resume", default="")
    ap.add_argument("--patience", type=int, default=8)
    return ap.parse_args()


# ---------------------------------------------------------------- callbacks ---
class Callback:
    def on_train_start(self, trainer): pass
    def on_step_end(self, trainer, loss): pass
    def on_epoch_end(self, trainer, metrics): pass


class EarlyStopping(Callback):
    def __init__(self, monitor="val_top1", patience=8, mode="max"):
        self.monitor, self.patience, self.mode = monitor, patience, mode
        self.best, self.bad_epochs = None, 0

    def on_epoch_end(self, trainer, metrics):
        v = metrics[self.monitor]
        if self.best is None or (v > self.best if self.mode == "max" else v < self.best):
            self.best, self.bad_epochs = v, 0
        else:
            self.bad_epochs += 1
        if self.bad_epochs >= self.patience:
            trainer.stop_training = True


class ModelCheckpoint(Callback):
    def __init__(self, out_dir, monitor="val_top1"):
        self.out_dir = Path(out_dir)
        self.monitor = monitor
        self.best = -1.0

    def on_epoch_end(self, trainer, metrics):
        if trainer.rank != 0:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        trainer.save_checkpoint(self.out_dir / "last.pt")
        if metrics[self.monitor] > self.best:
            self.best = metrics[self.monitor]
            trainer.save_checkpoint(self.out_dir / "best.pt")


class LRMonitor(Callback):
    def on_epoch_end(self, trainer, metrics):
        metrics["lr"] = trainer.optimizer.param_groups[0]["lr"]


class ProgressLogger(Callback):
    def on_train_start(self, trainer):
        self.t0 = time.time()

    def on_epoch_end(self, trainer, metrics):
        if trainer.rank == 0:
            msg = " ".join(f"{k}={v:.4f}" for k, v in metrics.items())
            logger.info("[epoch %d/%d %.0fs] %s", trainer.epoch + 1, trainer.max_epochs, time.time() - self.t0, msg)


# ------------------------------------------------------------------ trainer ---
class Trainer:
    def __init__(self, model, criterion, optimizer, scheduler, train_loader, val_loader,
                 max_epochs, local_rank, callbacks=(), amp=False, clip_grad=None):
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.device = torch.device(f"cuda:{local_rank}")
        model = model.to(self.device)
        self.model = DDP(model, device_ids=[local_rank]) if self.world_size > 1 else model
        self.criterion = criterion
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.max_epochs = max_epochs
        self.callbacks = list(callbacks)
        self.scaler = torch.cuda.amp.GradScaler(enabled=amp)
        self.amp = amp
        self.clip_grad = clip_grad
        self.start_epoch = 0
        self.epoch = 0
        self.stop_training = False

    def _raw(self):
        return self.model.module if isinstance(self.model, DDP) else self.model

    def save_checkpoint(self, path):
        torch.save({
            "epoch": self.epoch,
            "model": self._raw().state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
        }, path)

    def resume(self, path):
        ckpt = torch.load(path)
        self._raw().load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        self.scaler.load_state_dict(ckpt["scaler"])
        self.start_epoch = ckpt["epoch"] + 1
        if self.rank == 0:
            logger.info("resumed from %s (epoch %d)", path, ckpt["epoch"])

    def _reduce(self, values):
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.world_size > 1:
            dist.all_reduce(t)
        return t.tolist()

    def train_epoch(self):
        self.model.train()
        self.train_loader.sampler.set_epoch(self.epoch)
        loss_sum, n = 0.0, 0
        it = tqdm(self.train_loader, disable=self.rank != 0, desc=f"train {self.epoch}")
        for images, targets in it:
            images = images.to(self.device, non_blocking=True)
            targets = targets.to(self.device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=self.amp):
                loss = self.criterion(self.model(images), targets)
            self.optimizer.zero_grad(set_to_none=True)
            self.scaler.scale(loss).backward()
            if self.clip_grad:
                self.scaler.unscale_(self.optimizer)
                nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            loss_sum += loss.item() * images.size(0)
            n += images.size(0)
            for cb in self.callbacks:
                cb.on_step_end(self, loss.item())
        self.scheduler.step()
        loss_sum, n = self._reduce([loss_sum, n])
        return {"train_loss": loss_sum / n}

    @torch.no_grad()
    def validate(self):
        model = self._raw()
        model.eval()
        correct1 = correct5 = total = 0
        for images, targets in self.val_loader:
            images = images.to(self.device, non_blocking=True)
            targets = targets.to(self.device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=self.amp):
                logits = model(images)
            top5 = logits.topk(5, dim=1).indices
            correct1 += (top5[:, 0] == targets).sum().item()
            correct5 += (top5 == targets[:, None]).any(dim=1).sum().item()
            total += targets.numel()
        correct1, correct5, total = self._reduce([correct1, correct5, total])
        return {"val_top1": correct1 / total, "val_top5": correct5 / total}

    def fit(self):
        for cb in self.callbacks:
            cb.on_train_start(self)
        for epoch in range(self.start_epoch, self.max_epochs):
            self.epoch = epoch
            metrics = self.train_epoch()
            metrics.update(self.validate())
            for cb in self.callbacks:
                cb.on_epoch_end(self, metrics)
            if self.stop_training:
                break


# --------------------------------------------------------------------- main ---
def build_loaders(args, rank, world_size):
    normalize = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                   transforms.ColorJitter(0.2, 0.2, 0.2), transforms.ToTensor(), normalize])
    val_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), normalize])
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    # each rank evaluates a disjoint slice of val (no padding), counts are all-reduced
    val_shard = Subset(val_set, list(range(rank, len(val_set), world_size)))
    train_loader = DataLoader(train_set, batch_size=args.batch_size,
                              sampler=DistributedSampler(train_set, num_replicas=world_size, rank=rank),
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_shard, batch_size=args.batch_size, shuffle=False,
                            num_workers=args.workers, pin_memory=True)
    return train_loader, val_loader, len(train_set.classes)


def main():
    args = get_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s | %(message)s")
    torch.backends.cudnn.benchmark = True

    train_loader, val_loader, num_classes = build_loaders(args, rank, world_size)

    model = models.resnet50(weights=models.ResNet50_Weights.IMAGENET1K_V2)
    model.fc = nn.Linear(model.fc.in_features, num_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)

    # linear scaling rule: lr is given for a global batch of 256
    lr = args.lr * args.batch_size * world_size / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum,
                                weight_decay=args.wd, nesterov=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)

    callbacks = [LRMonitor(), ProgressLogger(), ModelCheckpoint(args.out),
                 EarlyStopping(patience=args.patience)]
    trainer = Trainer(model, criterion, optimizer, scheduler, train_loader, val_loader,
                      args.epochs, local_rank, callbacks, amp=args.amp, clip_grad=args.clip_grad)
    if args.resume:
        trainer.resume(args.resume)
    trainer.fit()

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
