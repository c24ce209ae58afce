"""Leaf disease classifier for the agronomy app (EfficientNetV2-S, 38 classes).

Trains with the toolkit Trainer, then scores the held-out test split with the
best checkpoint and writes a per-class report next to it.

    torchrun --standalone --nproc_per_node=4 19_plant_disease_effv2.py --data /data/plantvillage --epochs 25
"""
import argparse
import json
import logging
import math
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import classification_report
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets, models, transforms
from tqdm import tqdm

logger = logging.getLogger("plants")


def build_model(num_classes, pretrained=True):
    weights = models.EfficientNet_V2_S_Weights.IMAGENET1K_V1 if pretrained else None
    model = models.efficientnet_v2_s(weights=weights)
    model.classifier[1] = nn.Linear(model.classifier[1].in_features, num_classes)
    return model


# ------------------------------------------------------------------ callbacks
class Callback:
    def on_train_start(self, trainer): pass
    def on_batch_end(self, trainer, logs): pass
    def on_epoch_end(self, trainer, logs): pass


class ModelCheckpoint(Callback):
    def __init__(self, dirpath, monitor="val_acc", mode="max"):
        self.dirpath, self.monitor, self.mode = Path(dirpath), monitor, mode
        self.best_score = -math.inf if mode == "max" else math.inf
        self.best_path = None

    def on_epoch_end(self, trainer, logs):
        if trainer.global_rank != 0:
            return
        score = logs[self.monitor]
        if (score > self.best_score) if self.mode == "max" else (score < self.best_score):
            self.best_score = score
            self.best_path = self.dirpath / "best.ckpt"
            self.dirpath.mkdir(parents=True, exist_ok=True)
            torch.save({"state_dict": trainer.model.state_dict(), "epoch": trainer.current_epoch,
                        "classes": trainer.classes, self.monitor: score}, self.best_path)


class EarlyStopping(Callback):
    def __init__(self, monitor="val_loss", patience=5):
        self.monitor, self.patience = monitor, patience
        self.best, self.wait = math.inf, 0

    def on_epoch_end(self, trainer, logs):
        if logs[self.monitor] < self.best:
            self.best, self.wait = logs[self.monitor], 0
        else:
            self.wait += 1
            if self.wait >= self.patience:
                trainer.should_stop = True


class ProgressBar(Callback):
    def on_train_start(self, trainer):
        self.bar = None

    def on_batch_end(self, trainer, logs):
        if trainer.global_rank != 0:
            return
        if logs["batch_idx"] == 0:
            self.bar = tqdm(total=trainer.num_batches, desc=f"epoch {trainer.current_epoch}", leave=False)
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{logs['loss']:.4f}", lr=f"{trainer.optimizer.param_groups[0]['lr']:.2e}")

    def on_epoch_end(self, trainer, logs):
        if trainer.global_rank == 0:
            if self.bar is not None:
                self.bar.close()
            logger.info("epoch %d: %s", trainer.current_epoch, {k: round(v, 4) for k, v in logs.items()})


# ------------------------------------------------------------------ trainer
class Trainer:
    def __init__(self, model, optimizer, scheduler, local_rank, classes, callbacks, max_epochs, grad_clip=None):
        self.global_rank = dist.get_rank()
        self.device = torch.device("cuda", local_rank)
        self.model = DDP(model.to(self.device), device_ids=[local_rank])
        self.optimizer, self.scheduler = optimizer, scheduler
        self.classes, self.callbacks = classes, callbacks
        self.max_epochs, self.grad_clip = max_epochs, grad_clip
        self.current_epoch, self.num_batches, self.should_stop = 0, 0, False

    def _call(self, hook, *args):
        for cb in self.callbacks:
            getattr(cb, hook)(self, *args)

    def _reduce(self, *vals):
        t = torch.tensor(vals, device=self.device, dtype=torch.float64)
        dist.all_reduce(t)
        return t.tolist()

    def train_epoch(self, loader):
        self.model.train()
        self.num_batches = len(loader)
        loss_sum, n = 0.0, 0
        for batch_idx, (x, y) in enumerate(loader):
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(self.model(x), y, label_smoothing=0.1)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if self.grad_clip:
                nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
            loss_sum += loss.item() * y.size(0)
            n += y.size(0)
            self._call("on_batch_end", {"batch_idx": batch_idx, "loss": loss.item()})
        loss_sum, n = self._reduce(loss_sum, n)
        return {"train_loss": loss_sum / n}

    @torch.no_grad()
    def validate(self, loader):
        net = self.model.module.eval()
        loss_sum, correct, n = 0.0, 0, 0
        for x, y in loader:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = net(x).float()
            loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
            correct += (logits.argmax(1) == y).sum().item()
            n += y.size(0)
        loss_sum, correct, n = self._reduce(loss_sum, correct, n)
        return {"val_loss": loss_sum / n, "val_acc": correct / n}

    def fit(self, train_loader, val_loader):
        self._call("on_train_start")
        for epoch in range(self.max_epochs):
            self.current_epoch = epoch
            train_loader.sampler.set_epoch(epoch)
            logs = self.train_epoch(train_loader)
            logs.update(self.validate(val_loader))
            self._call("on_epoch_end", logs)
            if self.should_stop:
                break


@torch.no_grad()
def test_best(ckpt_path, test_set, device, out_dir):
    ckpt = torch.load(ckpt_path, map_location=device)
    model = build_model(len(ckpt["classes"]), pretrained=False)
    model.load_state_dict(ckpt["state_dict"])
    model.to(device).eval()
    preds, targets = [], []
    for x, y in DataLoader(test_set, batch_size=128, num_workers=8):
        preds.append(model(x.to(device)).argmax(1).cpu())
        targets.append(y)
    preds, targets = torch.cat(preds).numpy(), torch.cat(targets).numpy()
    report = classification_report(targets, preds, target_names=ckpt["classes"], output_dict=True, digits=4)
    (Path(out_dir) / "test_report.json").write_text(json.dumps(report, indent=2))
    logger.info("test accuracy %.4f (macro F1 %.4f)", report["accuracy"], report["macro avg"]["f1-score"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--epochs", type=int, default=25)
    ap.add_argument("--batch-size", type=int, default=48)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--grad-clip", type=float, default=2.0)
    ap.add_argument("--out", default="runs/plant_effv2s")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([transforms.RandomResizedCrop(288), transforms.RandomHorizontalFlip(),
                                   transforms.RandomVerticalFlip(), transforms.TrivialAugmentWide(),
                                   transforms.ToTensor(), norm])
    eval_tf = transforms.Compose([transforms.Resize(320), transforms.CenterCrop(288), transforms.ToTensor(), norm])
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), eval_tf)
    test_set = datasets.ImageFolder(os.path.join(args.data, "test"), eval_tf)

    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=DistributedSampler(train_set),
                              num_workers=8, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=96,
                            num_workers=8, pin_memory=True)

    model = build_model(len(train_set.classes))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.02)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, epochs=args.epochs,
                                                    steps_per_epoch=len(train_loader), pct_start=0.1)
    ckpt_cb = ModelCheckpoint(args.out)
    callbacks = [ProgressBar(), ckpt_cb, EarlyStopping()]
    trainer = Trainer(model, optimizer, scheduler, local_rank, train_set.classes, callbacks,
                      args.epochs, args.grad_clip)
    trainer.fit(train_loader, val_loader)

    dist.barrier()
    if rank == 0:
        test_best(ckpt_cb.best_path, test_set, device, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
