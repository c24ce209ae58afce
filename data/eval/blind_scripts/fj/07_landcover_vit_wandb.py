#!/usr/bin/env python
"""Land-cover scene classification from Sentinel-2 RGB chips (ViT-S/16).

Experiment tracking goes to the client's W&B workspace.

    torchrun --standalone --nproc_per_node=8 07_landcover_vit_wandb.py \
        --data /datasets/eurosat_rgb --wandb-project landcover --run-name vits16-bs512
"""
import argparse
import logging
import math
import os
import time
from pathlib import Path

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import wandb
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets, transforms

logger = logging.getLogger("landcover")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--model", default="vit_small_patch16_224.augreg_in21k")
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--base-lr", type=float, default=5e-4, help="for a global batch of 512")
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--mixup", type=float, default=0.2)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--out", default="runs/landcover")
    p.add_argument("--wandb-project", default="landcover")
    p.add_argument("--run-name", default=None)
    return p.parse_args()


class Callback:
    def on_fit_start(self, trainer): pass
    def on_step_end(self, trainer, logs): pass
    def on_epoch_end(self, trainer, logs): pass
    def on_fit_end(self, trainer): pass


class WandbLogger(Callback):
    def __init__(self, project, name, config, log_every=25):
        self.project, self.name, self.config, self.log_every = project, name, config, log_every
        self.run = None

    def on_fit_start(self, trainer):
        self.run = wandb.init(project=self.project, name=self.name, config=self.config)
        self.run.define_metric("epoch/*", step_metric="epoch")

    def on_step_end(self, trainer, logs):
        if trainer.global_step % self.log_every == 0:
            self.run.log({"train/loss": logs["loss"],
                          "train/lr": trainer.optimizer.param_groups[0]["lr"]}, step=trainer.global_step)

    def on_epoch_end(self, trainer, logs):
        self.run.log({**{f"epoch/{k}": v for k, v in logs.items()}, "epoch": trainer.epoch},
                     step=trainer.global_step)

    def on_fit_end(self, trainer):
        self.run.finish()


class ModelCheckpoint(Callback):
    def __init__(self, out_dir, monitor="val_acc"):
        self.out_dir, self.monitor, self.best = Path(out_dir), monitor, 0.0

    def on_epoch_end(self, trainer, logs):
        if trainer.rank != 0:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        ckpt = {"model": trainer.model.module.state_dict(), "epoch": trainer.epoch, "val_acc": logs["val_acc"]}
        torch.save(ckpt, self.out_dir / "last.pt")
        if logs[self.monitor] > self.best:
            self.best = logs[self.monitor]
            torch.save(ckpt, self.out_dir / "best.pt")


class EarlyStopping(Callback):
    def __init__(self, monitor="val_loss", patience=10):
        self.monitor, self.patience, self.best, self.count = monitor, patience, math.inf, 0

    def on_epoch_end(self, trainer, logs):
        if logs[self.monitor] < self.best:
            self.best, self.count = logs[self.monitor], 0
        else:
            self.count += 1
            trainer.should_stop = self.count >= self.patience


def cosine_with_warmup(optimizer, warmup_steps, total_steps):
    def f(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        prog = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * prog))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, f)


class Trainer:
    def __init__(self, model, optimizer, scheduler, device, callbacks, mixup=None, clip_grad=None):
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = device
        self.model = DDP(model.to(device), device_ids=[device.index])
        self.optimizer, self.scheduler = optimizer, scheduler
        self.callbacks = callbacks
        self.mixup = mixup
        self.clip_grad = clip_grad
        self.train_loss_fn = SoftTargetCrossEntropy() if mixup else nn.CrossEntropyLoss()
        self.global_step, self.epoch, self.should_stop = 0, 0, False

    def hook(self, name, *a):
        for cb in self.callbacks:
            getattr(cb, name)(self, *a)

    def train_epoch(self, loader):
        self.model.train()
        for x, y in loader:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            if self.mixup is not None:
                x, y = self.mixup(x, y)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = self.train_loss_fn(self.model(x), y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad)
            self.optimizer.step()
            self.scheduler.step()
            self.global_step += 1
            self.hook("on_step_end", {"loss": loss.item()})

    @torch.no_grad()
    def evaluate(self, loader):
        net = self.model.module.eval()
        buf = torch.zeros(3, device=self.device, dtype=torch.float64)
        for x, y in loader:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = net(x).float()
            buf[0] += nn.functional.cross_entropy(logits, y, reduction="sum")
            buf[1] += (logits.argmax(-1) == y).sum()
            buf[2] += y.numel()
        dist.all_reduce(buf)
        return {"val_loss": (buf[0] / buf[2]).item(), "val_acc": (buf[1] / buf[2]).item()}

    def fit(self, train_loader, val_loader, epochs):
        self.hook("on_fit_start")
        for epoch in range(epochs):
            self.epoch = epoch
            train_loader.sampler.set_epoch(epoch)
            t0 = time.time()
            self.train_epoch(train_loader)
            logs = self.evaluate(val_loader)
            logs["epoch_time"] = time.time() - t0
            if self.rank == 0:
                logger.info("epoch %d val_loss %.4f val_acc %.4f (%.0fs)", epoch, logs["val_loss"],
                            logs["val_acc"], logs["epoch_time"])
            self.hook("on_epoch_end", logs)
            if self.should_stop:
                break
        self.hook("on_fit_end")


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING)

    norm = transforms.Normalize((0.344, 0.380, 0.408), (0.203, 0.137, 0.115))
    train_tf = transforms.Compose([transforms.RandomResizedCrop(224, scale=(0.5, 1.0)),
                                   transforms.RandomHorizontalFlip(), transforms.RandomVerticalFlip(),
                                   transforms.ToTensor(), norm])
    val_tf = transforms.Compose([transforms.Resize(224), transforms.ToTensor(), norm])
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    num_classes = len(train_set.classes)

    train_loader = DataLoader(train_set, batch_size=args.batch_size,
                              sampler=DistributedSampler(train_set, shuffle=True, drop_last=True),
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=128,
                            num_workers=args.workers, pin_memory=True)

    model = timm.create_model(args.model, pretrained=True, num_classes=num_classes, drop_path_rate=0.1)
    global_bs = args.batch_size * world
    lr = args.base_lr * global_bs / 512
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    total_steps = args.epochs * len(train_loader)
    scheduler = cosine_with_warmup(optimizer, args.warmup_epochs * len(train_loader), total_steps)
    mixup = Mixup(mixup_alpha=args.mixup, label_smoothing=0.1, num_classes=num_classes) if args.mixup > 0 else None

    config = {**vars(args), "world_size": world, "global_batch_size": global_bs, "lr": lr}
    callbacks = [WandbLogger(args.wandb_project, args.run_name, config),
                 ModelCheckpoint(args.out), EarlyStopping(patience=10)]
    trainer = Trainer(model, optimizer, scheduler, device, callbacks, mixup=mixup, clip_grad=args.clip_grad)
    trainer.fit(train_loader, val_loader, args.epochs)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
