#!/usr/bin/env python
"""Environmental sound event classifier (factory-floor alarms, 24 classes).

Log-mel spectrograms are precomputed by featurize.py into <data>/{train,val}.npz.

    torchrun --standalone --nproc_per_node=4 17_sound_event_cnn.py --data data/sound_mels --epochs 80
"""
import argparse
import json
import logging
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch.utils.tensorboard import SummaryWriter

log = logging.getLogger("sound")


class MelDataset(Dataset):
    def __init__(self, path, train, crop=256):
        d = np.load(path)
        self.mels = d["mels"]  # (N, 128, T) float16
        self.labels = d["labels"].astype(np.int64)
        self.train, self.crop = train, crop

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        m = torch.from_numpy(self.mels[i].astype(np.float32))
        T = m.shape[-1]
        if self.train:
            s = np.random.randint(0, max(1, T - self.crop))
            m = m[:, s:s + self.crop]
            # SpecAugment-style masks
            f0 = np.random.randint(0, 128 - 16)
            m[f0:f0 + np.random.randint(0, 16)] = 0
            t0 = np.random.randint(0, max(1, m.shape[-1] - 32))
            m[:, t0:t0 + np.random.randint(0, 32)] = 0
        else:
            m = m[:, :self.crop]
        if m.shape[-1] < self.crop:
            m = F.pad(m, (0, self.crop - m.shape[-1]))
        return m.unsqueeze(0), self.labels[i]


def conv_block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                         nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                         nn.AvgPool2d(2))


class CNN10(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.bn0 = nn.BatchNorm2d(1)
        self.features = nn.Sequential(conv_block(1, 64), conv_block(64, 128), conv_block(128, 256), conv_block(256, 512))
        self.fc = nn.Sequential(nn.Dropout(0.3), nn.Linear(512, 512), nn.ReLU(), nn.Dropout(0.3), nn.Linear(512, num_classes))

    def forward(self, x):
        x = self.features(self.bn0(x))
        x = x.mean(dim=2)
        x = x.max(dim=2).values + x.mean(dim=2)
        return self.fc(x)


# ------------------------------------------------------------------- callbacks
class Callback:
    def on_log(self, trainer, logs): pass
    def on_epoch_end(self, trainer, logs): pass
    def on_fit_end(self, trainer): pass


class TensorBoardCallback(Callback):
    def __init__(self, logdir):
        self.logdir, self.writer = logdir, None

    def on_log(self, trainer, logs):
        if self.writer is None:
            self.writer = SummaryWriter(self.logdir)
        for k, v in logs.items():
            self.writer.add_scalar(k, v, trainer.global_step)

    def on_epoch_end(self, trainer, logs):
        if trainer.is_main:
            self.on_log(trainer, {f"epoch/{k}": v for k, v in logs.items()})

    def on_fit_end(self, trainer):
        if self.writer is not None:
            self.writer.close()


class ModelCheckpoint(Callback):
    def __init__(self, out_dir, monitor="val_acc"):
        self.out_dir, self.monitor, self.best = Path(out_dir), monitor, -1.0

    def on_epoch_end(self, trainer, logs):
        if not trainer.is_main:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        torch.save({"model": trainer.model.module.state_dict(), "optimizer": trainer.optimizer.state_dict(),
                    "epoch": trainer.epoch}, self.out_dir / "last.pt")
        if logs[self.monitor] > self.best:
            self.best = logs[self.monitor]
            torch.save(trainer.model.module.state_dict(), self.out_dir / "best_weights.pt")
            (self.out_dir / "best.json").write_text(json.dumps({"epoch": trainer.epoch, **logs}, indent=1))


class EarlyStopping(Callback):
    def __init__(self, monitor="val_loss", patience=12):
        self.monitor, self.patience, self.best, self.wait = monitor, patience, math.inf, 0

    def on_epoch_end(self, trainer, logs):
        if logs[self.monitor] < self.best:
            self.best, self.wait = logs[self.monitor], 0
        else:
            self.wait += 1
        if self.wait >= self.patience:
            trainer.should_stop = True


# ------------------------------------------------------------------- trainer
class Trainer:
    def __init__(self, model, optimizer, scheduler, device, callbacks, log_every=50, clip_grad=3.0, mixup_alpha=0.4):
        self.device = device
        self.world = dist.get_world_size()
        self.is_main = dist.get_rank() == 0
        self.model = DDP(model.to(device), device_ids=[device.index])
        self.optimizer, self.scheduler, self.callbacks = optimizer, scheduler, callbacks
        self.log_every, self.clip_grad, self.mixup_alpha = log_every, clip_grad, mixup_alpha
        self.global_step, self.epoch, self.should_stop = 0, 0, False

    def _hook(self, name, *args):
        for cb in self.callbacks:
            getattr(cb, name)(self, *args)

    def _reduce_mean(self, t):
        t = t.clone()
        dist.all_reduce(t)
        return t / self.world

    def train_epoch(self, loader):
        self.model.train()
        t0 = time.time()
        for x, y in loader:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            lam = float(np.random.beta(self.mixup_alpha, self.mixup_alpha))
            perm = torch.randperm(x.size(0), device=self.device)
            x = lam * x + (1 - lam) * x[perm]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = self.model(x)
            loss = lam * F.cross_entropy(logits.float(), y) + (1 - lam) * F.cross_entropy(logits.float(), y[perm])
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad)
            self.optimizer.step()
            self.scheduler.step()
            self.global_step += 1
            if self.is_main and self.global_step % self.log_every == 0:
                avg_loss = self._reduce_mean(loss.detach())
                self._hook("on_log", {"train/loss": avg_loss.item(), "train/grad_norm": grad_norm.item(),
                                      "train/lr": self.scheduler.get_last_lr()[0],
                                      "train/it_per_s": self.log_every / (time.time() - t0)})
                t0 = time.time()

    @torch.no_grad()
    def evaluate(self, loader):
        net = self.model.module
        net.eval()
        acc = torch.zeros(3, device=self.device, dtype=torch.float64)
        for x, y in loader:
            x, y = x.to(self.device), y.to(self.device)
            logits = net(x)
            acc[0] += F.cross_entropy(logits, y, reduction="sum").double()
            acc[1] += (logits.argmax(1) == y).sum()
            acc[2] += y.numel()
        dist.all_reduce(acc)
        return {"val_loss": (acc[0] / acc[2]).item(), "val_acc": (acc[1] / acc[2]).item()}

    def fit(self, train_loader, val_loader, epochs):
        for epoch in range(epochs):
            self.epoch = epoch
            train_loader.sampler.set_epoch(epoch)
            self.train_epoch(train_loader)
            logs = self.evaluate(val_loader)
            if self.is_main:
                log.info("epoch %d %s", epoch, logs)
            self._hook("on_epoch_end", logs)
            if self.should_stop:
                break
        self._hook("on_fit_end")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", default="runs/sound_cnn10")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    np.random.seed(rank)
    torch.manual_seed(0)

    train_set = MelDataset(os.path.join(args.data, "train.npz"), train=True)
    val_set = MelDataset(os.path.join(args.data, "val.npz"), train=False)
    num_classes = int(train_set.labels.max()) + 1
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=DistributedSampler(train_set),
                              num_workers=6, pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world)),
                            batch_size=128, num_workers=4)

    model = CNN10(num_classes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, epochs=args.epochs,
                                                    steps_per_epoch=len(train_loader))
    callbacks = [TensorBoardCallback(os.path.join(args.out, "tb")), ModelCheckpoint(args.out), EarlyStopping()]
    trainer = Trainer(model, optimizer, scheduler, device, callbacks)
    trainer.fit(train_loader, val_loader, args.epochs)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
