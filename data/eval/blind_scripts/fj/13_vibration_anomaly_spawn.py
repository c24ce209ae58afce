#!/usr/bin/env python
"""Bearing-fault detection from accelerometer windows (1D ResNet, binary).

This one is started with torch.multiprocessing (the client's scheduler only
runs a plain `python` command on a single 4-GPU box):

    python 13_vibration_anomaly_spawn.py --data data/vibration --gpus 4 --epochs 40
"""
import argparse
import logging
import math
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

log = logging.getLogger("vibration")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--patience", type=int, default=6)
    ap.add_argument("--port", type=int, default=29533)
    ap.add_argument("--out", default="runs/vibration")
    ap.add_argument("--resume", default=None)
    return ap.parse_args()


# ----------------------------------------------------------------- data / model
class WindowDataset(Dataset):
    def __init__(self, path, train):
        d = np.load(path)
        self.x = d["windows"].astype(np.float32)  # (N, 3, 4096)
        self.y = d["labels"].astype(np.float32)
        self.train = train

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        x = self.x[i]
        if self.train:
            shift = np.random.randint(0, x.shape[-1])
            x = np.roll(x, shift, axis=-1) * np.random.uniform(0.8, 1.2)
        return torch.from_numpy(np.ascontiguousarray(x)), torch.tensor(self.y[i])


def collate_windows(batch):
    xs, ys = zip(*batch)
    x = torch.stack(xs)
    x = (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + 1e-6)
    return x, torch.stack(ys)


class ResBlock1d(nn.Module):
    def __init__(self, c_in, c_out, stride):
        super().__init__()
        self.conv1 = nn.Conv1d(c_in, c_out, 7, stride, 3, bias=False)
        self.bn1 = nn.BatchNorm1d(c_out)
        self.conv2 = nn.Conv1d(c_out, c_out, 7, 1, 3, bias=False)
        self.bn2 = nn.BatchNorm1d(c_out)
        self.down = nn.Sequential(nn.Conv1d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm1d(c_out)) \
            if stride != 1 or c_in != c_out else nn.Identity()

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.down(x))


class VibNet(nn.Module):
    def __init__(self, channels=(32, 64, 128, 256)):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv1d(3, channels[0], 15, 2, 7, bias=False), nn.BatchNorm1d(channels[0]), nn.ReLU())
        layers, c = [], channels[0]
        for c_out in channels:
            layers += [ResBlock1d(c, c_out, 2), ResBlock1d(c_out, c_out, 1)]
            c = c_out
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(c, 1)

    def forward(self, x):
        return self.head(self.body(self.stem(x)).mean(-1)).squeeze(-1)


# ----------------------------------------------------------------- callbacks
class Callback:
    def on_epoch_end(self, trainer, logs): pass


class ModelCheckpoint(Callback):
    def __init__(self, out_dir):
        self.out_dir, self.best = Path(out_dir), -1.0

    def on_epoch_end(self, trainer, logs):
        if trainer.rank == 0:
            trainer.save(self.out_dir / "last.pt")
            if logs["val_auroc"] > self.best:
                self.best = logs["val_auroc"]
                trainer.save(self.out_dir / "best.pt")


class EarlyStopping(Callback):
    def __init__(self, patience):
        self.patience, self.best, self.bad = patience, -1.0, 0

    def on_epoch_end(self, trainer, logs):
        # logs["val_auroc"] was broadcast from rank 0, so this is identical on every rank
        if logs["val_auroc"] > self.best:
            self.best, self.bad = logs["val_auroc"], 0
        else:
            self.bad += 1
        if self.bad >= self.patience:
            trainer.should_stop = True


class LRMonitor(Callback):
    def on_epoch_end(self, trainer, logs):
        if trainer.rank == 0:
            log.info("epoch %d lr=%.2e %s", trainer.epoch, trainer.optimizer.param_groups[0]["lr"],
                     {k: round(v, 4) for k, v in logs.items()})


# ----------------------------------------------------------------- trainer
class Trainer:
    def __init__(self, model, optimizer, scheduler, rank, world_size, callbacks):
        self.rank, self.world_size = rank, world_size
        self.device = torch.device("cuda", rank)
        self.model = DDP(model.to(self.device), device_ids=[rank])
        self.optimizer, self.scheduler, self.callbacks = optimizer, scheduler, callbacks
        self.epoch, self.start_epoch, self.should_stop = 0, 0, False

    def save(self, path):
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"model": self.model.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(), "epoch": self.epoch}, path)

    def resume(self, path):
        ckpt = torch.load(path, map_location=self.device)
        self.model.module.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        self.start_epoch = ckpt["epoch"] + 1

    def _gather_1d(self, t):
        """all_gather for 1-D tensors whose length differs per rank."""
        n = torch.tensor([t.numel()], device=self.device)
        sizes = [torch.zeros_like(n) for _ in range(self.world_size)]
        dist.all_gather(sizes, n)
        max_n = int(max(s.item() for s in sizes))
        padded = torch.zeros(max_n, dtype=t.dtype, device=self.device)
        padded[: t.numel()] = t
        out = [torch.zeros_like(padded) for _ in range(self.world_size)]
        dist.all_gather(out, padded)
        return torch.cat([o[: int(s.item())] for o, s in zip(out, sizes)])

    def train_epoch(self, loader):
        self.model.train()
        stats = torch.zeros(2, device=self.device)
        for x, y in loader:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(self.model(x), y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(self.model.parameters(), 5.0)
            self.optimizer.step()
            stats += torch.stack([loss.detach() * y.numel(), torch.tensor(float(y.numel()), device=self.device)])
        dist.all_reduce(stats)
        return {"train_loss": (stats[0] / stats[1]).item()}

    @torch.no_grad()
    def evaluate(self, loader):
        net = self.model.module
        net.eval()
        scores, labels = [], []
        for x, y in loader:
            scores.append(torch.sigmoid(net(x.to(self.device, non_blocking=True))))
            labels.append(y.to(self.device))
        scores = self._gather_1d(torch.cat(scores))
        labels = self._gather_1d(torch.cat(labels))
        auroc = torch.zeros(1, device=self.device)
        if self.rank == 0:
            auroc[0] = roc_auc_score(labels.cpu().numpy(), scores.cpu().numpy())
        dist.broadcast(auroc, src=0)
        return {"val_auroc": auroc.item()}

    def fit(self, train_loader, val_loader, epochs):
        for epoch in range(self.start_epoch, epochs):
            self.epoch = epoch
            train_loader.sampler.set_epoch(epoch)
            logs = self.train_epoch(train_loader)
            logs.update(self.evaluate(val_loader))
            self.scheduler.step()
            for cb in self.callbacks:
                cb.on_epoch_end(self, logs)
            if self.should_stop:
                break


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    torch.manual_seed(7)
    np.random.seed(7 + rank)  # augmentation only

    train_set = WindowDataset(os.path.join(args.data, "train.npz"), train=True)
    val_set = WindowDataset(os.path.join(args.data, "val.npz"), train=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, collate_fn=collate_windows,
                              sampler=DistributedSampler(train_set, num_replicas=world_size, rank=rank),
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world_size)),
                            batch_size=512, collate_fn=collate_windows, num_workers=2)

    model = VibNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    callbacks = [LRMonitor(), ModelCheckpoint(args.out), EarlyStopping(args.patience)]
    trainer = Trainer(model, optimizer, scheduler, rank, world_size, callbacks)
    if args.resume:
        trainer.resume(args.resume)
    trainer.fit(train_loader, val_loader, args.epochs)
    dist.destroy_process_group()


def main():
    args = parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
