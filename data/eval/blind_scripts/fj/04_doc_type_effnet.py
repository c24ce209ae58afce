#!/usr/bin/env python
"""Scanned-document type classifier (invoice / receipt / contract / ...).

EfficientNet-B3 from timm, trained with the consulting toolkit Trainer.
Single node, multi-GPU:

    torchrun --nproc_per_node=8 04_doc_type_effnet.py --data-root /mnt/shared/docs --accum 2
"""
import argparse
import logging
import math
import os
from contextlib import nullcontext
from pathlib import Path

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, transforms
from tqdm import tqdm

logger = logging.getLogger("doctype")


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-root", required=True)
    parser.add_argument("--arch", default="efficientnet_b3")
    parser.add_argument("--img-size", type=int, default=384)
    parser.add_argument("--batch-size", type=int, default=24, help="per GPU, per micro-step")
    parser.add_argument("--accum", type=int, default=1, help="gradient accumulation steps")
    parser.add_argument("--lr", type=float, default=4e-4)
    parser.add_argument("--epochs", type=int, default=25)
    parser.add_argument("--clip-grad", type=float, default=2.0)
    parser.add_argument("--patience", type=int, default=4)
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--out", default="/mnt/shared/runs/doctype")
    parser.add_argument("--resume", action="store_true", help="continue from <out>/last.pt if present")
    return parser.parse_args()


class Callback:
    def on_fit_start(self, trainer): pass
    def on_step_end(self, trainer, logs): pass
    def on_epoch_end(self, trainer, logs): pass


class EarlyStopping(Callback):
    """Every rank sees the same all-reduced logs, so every rank stops at the same epoch."""

    def __init__(self, monitor="val_loss", patience=4, min_delta=1e-4):
        self.monitor, self.patience, self.min_delta = monitor, patience, min_delta
        self.best, self.wait = math.inf, 0

    def on_epoch_end(self, trainer, logs):
        if logs[self.monitor] < self.best - self.min_delta:
            self.best, self.wait = logs[self.monitor], 0
        else:
            self.wait += 1
            trainer.should_stop = self.wait >= self.patience


class ModelCheckpoint(Callback):
    def __init__(self, out_dir, monitor="val_acc"):
        self.out_dir, self.monitor, self.best = Path(out_dir), monitor, -math.inf

    def on_epoch_end(self, trainer, logs):
        if trainer.is_main:
            trainer.save_checkpoint(self.out_dir / "last.pt")
            if logs[self.monitor] > self.best:
                self.best = logs[self.monitor]
                trainer.save_checkpoint(self.out_dir / "best.pt")


class LRMonitor(Callback):
    def __init__(self, writer, every=20):
        self.writer, self.every = writer, every

    def on_step_end(self, trainer, logs):
        if self.writer is not None and trainer.global_step % self.every == 0:
            self.writer.add_scalar("train/lr", trainer.optimizer.param_groups[0]["lr"], trainer.global_step)
            self.writer.add_scalar("train/loss", logs["loss"], trainer.global_step)


class Trainer:
    def __init__(self, model, optimizer, scheduler, criterion, device, *, accum=1, clip_grad=None,
                 callbacks=(), writer=None):
        self.device = device
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.is_main = not dist.is_initialized() or dist.get_rank() == 0
        model = model.to(device)
        self.model = DDP(model, device_ids=[device.index]) if self.world_size > 1 else model
        self.optimizer, self.scheduler, self.criterion = optimizer, scheduler, criterion
        self.accum, self.clip_grad = accum, clip_grad
        self.callbacks, self.writer = list(callbacks), writer
        self.scaler = torch.cuda.amp.GradScaler()
        self.epoch, self.start_epoch, self.global_step = 0, 0, 0
        self.should_stop = False

    @property
    def raw_model(self):
        return self.model.module if isinstance(self.model, DDP) else self.model

    def save_checkpoint(self, path):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save({"model": self.raw_model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                    "epoch": self.epoch, "global_step": self.global_step}, tmp)
        os.replace(tmp, path)

    def load_checkpoint(self, path):
        state = torch.load(path, map_location="cpu")
        self.raw_model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.start_epoch = state["epoch"] + 1
        self.global_step = state["global_step"]

    def _sum(self, *xs):
        t = torch.tensor(xs, dtype=torch.float64, device=self.device)
        if self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()

    def train_epoch(self, loader):
        self.model.train()
        loss_sum, seen = 0.0, 0
        n = len(loader)
        for i, (x, y) in enumerate(tqdm(loader, disable=not self.is_main, desc=f"ep{self.epoch}")):
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            boundary = (i + 1) % self.accum == 0 or i + 1 == n
            # skip the gradient all-reduce on intermediate micro-batches
            ctx = self.model.no_sync() if (self.world_size > 1 and not boundary) else nullcontext()
            with ctx:
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = self.criterion(self.model(x), y)
                self.scaler.scale(loss / self.accum).backward()
            loss_sum += loss.item() * y.size(0)
            seen += y.size(0)
            if boundary:
                self.scaler.unscale_(self.optimizer)
                nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad)
                self.scaler.step(self.optimizer)
                self.scaler.update()
                self.optimizer.zero_grad(set_to_none=True)
                self.scheduler.step()
                self.global_step += 1
                for cb in self.callbacks:
                    cb.on_step_end(self, {"loss": loss.item()})
        loss_sum, seen = self._sum(loss_sum, seen)
        return {"train_loss": loss_sum / seen}

    @torch.no_grad()
    def evaluate(self, loader):
        model = self.raw_model.eval()
        loss_sum, correct, seen = 0.0, 0, 0
        for x, y in loader:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(x)
            loss_sum += nn.functional.cross_entropy(logits.float(), y, reduction="sum").item()
            correct += (logits.argmax(1) == y).sum().item()
            seen += y.size(0)
        loss_sum, correct, seen = self._sum(loss_sum, correct, seen)
        return {"val_loss": loss_sum / seen, "val_acc": correct / seen}

    def fit(self, train_loader, val_loader, epochs):
        for cb in self.callbacks:
            cb.on_fit_start(self)
        for epoch in range(self.start_epoch, epochs):
            self.epoch = epoch
            train_loader.sampler.set_epoch(epoch)
            logs = self.train_epoch(train_loader)
            logs.update(self.evaluate(val_loader))
            if self.is_main:
                logger.info("epoch %d: %s", epoch, {k: round(v, 4) for k, v in logs.items()})
                if self.writer:
                    for k, v in logs.items():
                        self.writer.add_scalar(f"epoch/{k}", v, epoch)
            for cb in self.callbacks:
                cb.on_epoch_end(self, logs)
            if self.should_stop:
                break


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [%(levelname)s] %(message)s")
    torch.manual_seed(1234)

    mean, std = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(args.img_size, scale=(0.6, 1.0), ratio=(0.6, 1.0)),
        transforms.RandomRotation(3), transforms.ColorJitter(0.3, 0.3),
        transforms.ToTensor(), transforms.Normalize(mean, std)])
    val_tf = transforms.Compose([transforms.Resize((args.img_size, args.img_size)),
                                 transforms.ToTensor(), transforms.Normalize(mean, std)])
    train_set = datasets.ImageFolder(os.path.join(args.data_root, "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data_root, "val"), val_tf)

    train_loader = DataLoader(train_set, batch_size=args.batch_size,
                              sampler=DistributedSampler(train_set, shuffle=True, drop_last=True),
                              num_workers=args.workers, pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=64,
                            num_workers=args.workers, pin_memory=True)

    model = timm.create_model(args.arch, pretrained=True, num_classes=len(train_set.classes),
                              drop_rate=0.3, drop_path_rate=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    steps_per_epoch = math.ceil(len(train_loader) / args.accum)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, pct_start=0.1,
                                                    total_steps=steps_per_epoch * args.epochs)
    writer = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None
    callbacks = [LRMonitor(writer), ModelCheckpoint(args.out), EarlyStopping(patience=args.patience)]
    trainer = Trainer(model, optimizer, scheduler, nn.CrossEntropyLoss(label_smoothing=0.1), device,
                      accum=args.accum, clip_grad=args.clip_grad, callbacks=callbacks, writer=writer)

    last = Path(args.out) / "last.pt"
    if args.resume and last.exists():
        trainer.load_checkpoint(last)
        logger.info("resuming at epoch %d", trainer.start_epoch)

    trainer.fit(train_loader, val_loader, args.epochs)

    # everyone waits for rank 0 to finish writing best.pt, then re-scores it
    dist.barrier()
    trainer.load_checkpoint(Path(args.out) / "best.pt")
    final = trainer.evaluate(val_loader)
    if rank == 0:
        logger.info("best checkpoint: %s", final)
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
