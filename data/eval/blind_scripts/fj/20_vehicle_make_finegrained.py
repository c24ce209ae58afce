#!/usr/bin/env python
"""Fine-grained vehicle make/model recognition for the parking analytics project.

Two-phase schedule: the pretrained backbone is kept frozen for the first
--freeze-epochs epochs (only the new head learns), then everything is trained
end-to-end with a lower backbone LR.

    torchrun --standalone --nproc_per_node=4 20_vehicle_make_finegrained.py --data /data/vehicles --epochs 40
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
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets, transforms

log = logging.getLogger("vehicles")


class FineGrainedNet(nn.Module):
    def __init__(self, backbone_name, num_classes, dropout=0.2):
        super().__init__()
        self.backbone = timm.create_model(backbone_name, pretrained=True, num_classes=0, global_pool="")
        c = self.backbone.num_features
        # GeM pooling + BNNeck head
        self.p = nn.Parameter(torch.ones(1) * 3.0)
        self.neck = nn.BatchNorm1d(c)
        self.drop = nn.Dropout(dropout)
        self.fc = nn.Linear(c, num_classes, bias=False)

    def gem(self, x, eps=1e-6):
        return F.avg_pool2d(x.clamp(min=eps).pow(self.p), x.shape[-2:]).pow(1.0 / self.p).flatten(1)

    def forward(self, x, freeze_backbone=False):
        if freeze_backbone:
            with torch.no_grad():
                feats = self.backbone(x)
        else:
            feats = self.backbone(x)
        return self.fc(self.drop(self.neck(self.gem(feats))))


# ------------------------------------------------------------------------ callbacks
class Callback:
    def on_epoch_start(self, trainer): pass
    def on_epoch_end(self, trainer, logs): pass


class ModelCheckpoint(Callback):
    def __init__(self, out_dir, monitor="val_top1"):
        self.out_dir, self.monitor, self.best = Path(out_dir), monitor, 0.0

    def on_epoch_end(self, trainer, logs):
        if trainer.rank != 0:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        payload = {"model": trainer.model.module.state_dict(), "optimizer": trainer.optimizer.state_dict(),
                   "epoch": trainer.epoch, "logs": logs}
        torch.save(payload, self.out_dir / "last.pt")
        if logs[self.monitor] > self.best:
            self.best = logs[self.monitor]
            torch.save(payload, self.out_dir / "best.pt")


class EarlyStopping(Callback):
    def __init__(self, monitor="val_top1", patience=8, warmup=0):
        self.monitor, self.patience, self.warmup = monitor, patience, warmup
        self.best, self.bad = 0.0, 0

    def on_epoch_end(self, trainer, logs):
        if trainer.epoch < self.warmup:
            return
        if logs[self.monitor] > self.best:
            self.best, self.bad = logs[self.monitor], 0
        else:
            self.bad += 1
        trainer.should_stop = self.bad >= self.patience


class LRMonitor(Callback):
    def on_epoch_start(self, trainer):
        if trainer.rank == 0:
            lrs = [f"{g['name']}={g['lr']:.2e}" for g in trainer.optimizer.param_groups]
            log.info("epoch %d (backbone %s) lr: %s", trainer.epoch,
                     "frozen" if trainer.freeze_backbone else "trainable", ", ".join(lrs))


# ------------------------------------------------------------------------ trainer
class Trainer:
    def __init__(self, model, optimizer, scheduler, device, callbacks, freeze_epochs=0, clip=5.0):
        self.rank = dist.get_rank()
        self.device = device
        self.model = DDP(model.to(device), device_ids=[device.index])
        self.optimizer, self.scheduler, self.callbacks = optimizer, scheduler, callbacks
        self.freeze_epochs, self.clip = freeze_epochs, clip
        self.epoch, self.should_stop, self.freeze_backbone = 0, False, False

    def _sum(self, *vals):
        t = torch.tensor(vals, device=self.device, dtype=torch.float64)
        dist.all_reduce(t)
        return t.tolist()

    def train_epoch(self, loader):
        self.model.train()
        loss_sum, n = 0.0, 0
        for x, y in loader:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = self.model(x, freeze_backbone=self.freeze_backbone)
            loss = F.cross_entropy(logits.float(), y, label_smoothing=0.1)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
            self.optimizer.step()
            self.scheduler.step()
            loss_sum += loss.item() * y.size(0)
            n += y.size(0)
        loss_sum, n = self._sum(loss_sum, n)
        return {"train_loss": loss_sum / n}

    @torch.no_grad()
    def evaluate(self, loader):
        net = self.model.module.eval()
        c1 = c5 = n = 0
        for x, y in loader:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                top5 = net(x).topk(5, dim=1).indices
            c1 += (top5[:, 0] == y).sum().item()
            c5 += (top5 == y[:, None]).any(1).sum().item()
            n += y.size(0)
        c1, c5, n = self._sum(c1, c5, n)
        return {"val_top1": c1 / n, "val_top5": c5 / n}

    def fit(self, train_loader, val_loader, epochs):
        for epoch in range(epochs):
            self.epoch = epoch
            self.freeze_backbone = epoch < self.freeze_epochs
            for cb in self.callbacks:
                cb.on_epoch_start(self)
            train_loader.sampler.set_epoch(epoch)
            t0 = time.time()
            logs = self.train_epoch(train_loader)
            logs.update(self.evaluate(val_loader))
            logs["epoch_min"] = (time.time() - t0) / 60
            if self.rank == 0:
                log.info("epoch %d %s", epoch, " ".join(f"{k}={v:.4f}" for k, v in logs.items()))
            for cb in self.callbacks:
                cb.on_epoch_end(self, logs)
            if self.should_stop:
                break


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--backbone", default="convnext_small.fb_in22k_ft_in1k")
    ap.add_argument("--img-size", type=int, default=384)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--backbone-lr-mult", type=float, default=0.1)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--freeze-epochs", type=int, default=3)
    ap.add_argument("--out", default="runs/vehicles_convnext_s")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([transforms.RandomResizedCrop(args.img_size, scale=(0.35, 1.0)),
                                   transforms.RandomHorizontalFlip(), transforms.ColorJitter(0.3, 0.3, 0.3, 0.05),
                                   transforms.ToTensor(), norm, transforms.RandomErasing(p=0.25)])
    val_tf = transforms.Compose([transforms.Resize(int(args.img_size * 1.14)), transforms.CenterCrop(args.img_size),
                                 transforms.ToTensor(), norm])
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=DistributedSampler(train_set, shuffle=True),
                              num_workers=8, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=64,
                            num_workers=8, pin_memory=True)

    model = FineGrainedNet(args.backbone, len(train_set.classes))
    head_params = [p for n, p in model.named_parameters() if not n.startswith("backbone.")]
    optimizer = torch.optim.AdamW([
        {"name": "backbone", "params": model.backbone.parameters(), "lr": args.lr * args.backbone_lr_mult},
        {"name": "head", "params": head_params, "lr": args.lr},
    ], weight_decay=0.05)
    total = args.epochs * len(train_loader)
    warm = len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))

    callbacks = [LRMonitor(), ModelCheckpoint(args.out), EarlyStopping(warmup=args.freeze_epochs)]
    trainer = Trainer(model, optimizer, scheduler, device, callbacks, freeze_epochs=args.freeze_epochs)
    trainer.fit(train_loader, val_loader, args.epochs)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
