"""Point-cloud classification of scanned machine parts (PointNet++-lite).

Clouds are pre-sampled to 2048 points and stored as one .npz per split.

    torchrun --nproc_per_node=4 16_pointnet_parts_cls.py --data data/parts_2048 --epochs 120
"""
import argparse
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
from tqdm import tqdm

logger = logging.getLogger("parts")


# ------------------------------------------------------------------------ data
class PointClouds(Dataset):
    def __init__(self, path, n_points=1024, augment=False):
        d = np.load(path)
        self.points = d["points"].astype(np.float32)  # (N, 2048, 3)
        self.labels = d["labels"].astype(np.int64)
        self.n_points, self.augment = n_points, augment

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        pts = self.points[i]
        if self.augment:
            pts = pts[np.random.choice(len(pts), self.n_points, replace=False)]
            theta = np.random.uniform(0, 2 * np.pi)
            rot = np.array([[np.cos(theta), 0, np.sin(theta)], [0, 1, 0], [-np.sin(theta), 0, np.cos(theta)]])
            pts = pts @ rot.T.astype(np.float32) * np.random.uniform(0.8, 1.25)
            pts = pts + np.clip(0.01 * np.random.randn(*pts.shape), -0.05, 0.05).astype(np.float32)
        else:
            pts = pts[: self.n_points]
        pts = pts - pts.mean(0)
        pts = pts / np.linalg.norm(pts, axis=1).max()
        return torch.from_numpy(pts.astype(np.float32)).t(), self.labels[i]


# ------------------------------------------------------------------------ model
class TNet(nn.Module):
    def __init__(self, k):
        super().__init__()
        self.k = k
        self.conv = nn.Sequential(nn.Conv1d(k, 64, 1), nn.BatchNorm1d(64), nn.ReLU(),
                                  nn.Conv1d(64, 128, 1), nn.BatchNorm1d(128), nn.ReLU(),
                                  nn.Conv1d(128, 1024, 1), nn.BatchNorm1d(1024), nn.ReLU())
        self.fc = nn.Sequential(nn.Linear(1024, 512), nn.BatchNorm1d(512), nn.ReLU(),
                                nn.Linear(512, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, k * k))
        nn.init.zeros_(self.fc[-1].weight)
        nn.init.zeros_(self.fc[-1].bias)

    def forward(self, x):
        m = self.fc(self.conv(x).max(-1).values).view(-1, self.k, self.k)
        return m + torch.eye(self.k, device=x.device)


class PointNetCls(nn.Module):
    def __init__(self, num_classes, dropout=0.4):
        super().__init__()
        self.tnet_in = TNet(3)
        self.mlp1 = nn.Sequential(nn.Conv1d(3, 64, 1), nn.BatchNorm1d(64), nn.ReLU())
        self.tnet_feat = TNet(64)
        self.mlp2 = nn.Sequential(nn.Conv1d(64, 128, 1), nn.BatchNorm1d(128), nn.ReLU(),
                                  nn.Conv1d(128, 1024, 1), nn.BatchNorm1d(1024))
        self.head = nn.Sequential(nn.Linear(1024, 512), nn.BatchNorm1d(512), nn.ReLU(), nn.Dropout(dropout),
                                  nn.Linear(512, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Dropout(dropout),
                                  nn.Linear(256, num_classes))

    def forward(self, x):
        x = torch.bmm(self.tnet_in(x), x)
        x = self.mlp1(x)
        t = self.tnet_feat(x)
        x = torch.bmm(t, x)
        feat = self.mlp2(x).max(-1).values
        return self.head(feat), t


def feature_transform_reg(t):
    eye = torch.eye(t.size(1), device=t.device)
    return ((t @ t.transpose(1, 2) - eye) ** 2).sum(dim=(1, 2)).mean()


# ------------------------------------------------------------------------ callbacks
class Callback:
    def on_epoch_end(self, trainer, logs): pass


class ModelCheckpoint(Callback):
    def __init__(self, out_dir, monitor="val_acc"):
        self.out_dir, self.monitor, self.best = Path(out_dir), monitor, 0.0

    def on_epoch_end(self, trainer, logs):
        if trainer.rank == 0 and logs[self.monitor] > self.best:
            self.best = logs[self.monitor]
            self.out_dir.mkdir(parents=True, exist_ok=True)
            torch.save({"model": trainer.unwrap().state_dict(), "epoch": trainer.epoch, **logs},
                       self.out_dir / "best.pt")


class EarlyStopping(Callback):
    def __init__(self, monitor="val_acc", patience=20):
        self.monitor, self.patience, self.best, self.bad = monitor, patience, 0.0, 0

    def on_epoch_end(self, trainer, logs):
        if logs[self.monitor] > self.best:
            self.best, self.bad = logs[self.monitor], 0
        else:
            self.bad += 1
        trainer.should_stop = self.bad >= self.patience


class ConsoleLogger(Callback):
    def on_epoch_end(self, trainer, logs):
        if trainer.rank == 0:
            logger.info("[%3d] lr=%.5f %s", trainer.epoch, trainer.optimizer.param_groups[0]["lr"],
                        " ".join(f"{k}={v:.4f}" for k, v in logs.items()))


# ------------------------------------------------------------------------ trainer
class Trainer:
    def __init__(self, model, optimizer, scheduler, local_rank, callbacks, sync_bn=True, reg_weight=1e-3):
        self.distributed = dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.local_rank = local_rank
        self.device = torch.device("cuda", local_rank)
        self.sync_bn = sync_bn
        self.model = self._wrap_model(model).to(self.device)
        self.optimizer, self.scheduler, self.callbacks = optimizer, scheduler, callbacks
        self.reg_weight = reg_weight
        self.epoch, self.should_stop = 0, False

    def _wrap_model(self, model):
        if not self.distributed:
            return model
        if self.sync_bn:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        return DDP(model, device_ids=[self.local_rank], output_device=self.local_rank)

    def unwrap(self):
        return self.model.module if isinstance(self.model, DDP) else self.model

    def _sum(self, *vals):
        t = torch.tensor(vals, dtype=torch.float64, device=self.device)
        if self.distributed:
            dist.all_reduce(t)
        return t.tolist()

    def train_epoch(self, loader):
        self.model.train()
        loss_sum, correct, n = 0.0, 0, 0
        for pts, y in tqdm(loader, disable=self.rank != 0, leave=False):
            pts, y = pts.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            logits, t = self.model(pts)
            loss = F.cross_entropy(logits, y, label_smoothing=0.2) + self.reg_weight * feature_transform_reg(t)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            loss_sum += loss.item() * y.size(0)
            correct += (logits.argmax(1) == y).sum().item()
            n += y.size(0)
        self.scheduler.step()
        loss_sum, correct, n = self._sum(loss_sum, correct, n)
        return {"train_loss": loss_sum / n, "train_acc": correct / n}

    @torch.no_grad()
    def evaluate(self, loader, num_classes):
        net = self.unwrap().eval()
        conf = torch.zeros(num_classes, num_classes, device=self.device, dtype=torch.float64)
        for pts, y in loader:
            pred = net(pts.to(self.device))[0].argmax(1)
            conf.index_put_((y.to(self.device), pred), torch.ones_like(pred, dtype=torch.float64), accumulate=True)
        if self.distributed:
            dist.all_reduce(conf)
        per_class = conf.diag() / conf.sum(1).clamp(min=1)
        return {"val_acc": (conf.diag().sum() / conf.sum()).item(), "val_mean_class_acc": per_class.mean().item()}

    def fit(self, train_loader, val_loader, epochs, num_classes):
        for epoch in range(epochs):
            self.epoch = epoch
            if self.distributed:
                train_loader.sampler.set_epoch(epoch)
            logs = self.train_epoch(train_loader)
            logs.update(self.evaluate(val_loader, num_classes))
            for cb in self.callbacks:
                cb.on_epoch_end(self, logs)
            if self.should_stop:
                break


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--num-points", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=120)
    ap.add_argument("--out", default="runs/parts_pointnet")
    args = ap.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    if "RANK" in os.environ:
        dist.init_process_group(backend="nccl")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    torch.manual_seed(0)

    train_set = PointClouds(os.path.join(args.data, "train.npz"), args.num_points, augment=True)
    val_set = PointClouds(os.path.join(args.data, "test.npz"), args.num_points)
    num_classes = int(train_set.labels.max()) + 1
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True) if world > 1 else None
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, shuffle=sampler is None,
                              num_workers=6, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world)),
                            batch_size=64, num_workers=4)

    model = PointNetCls(num_classes)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.7)
    callbacks = [ConsoleLogger(), ModelCheckpoint(args.out), EarlyStopping()]
    trainer = Trainer(model, optimizer, scheduler, local_rank, callbacks)
    trainer.fit(train_loader, val_loader, args.epochs, num_classes)

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
