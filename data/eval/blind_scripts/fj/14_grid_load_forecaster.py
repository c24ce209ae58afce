"""Day-ahead grid load forecasting: seq2seq LSTM over 7 days of 15-min history.

    torchrun --standalone --nproc_per_node=4 14_grid_load_forecaster.py \
        --data data/grid/load_2019_2023.parquet --horizon 96 --epochs 50
"""
import argparse
import heapq
import logging
import math
import os
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from tqdm import tqdm

logger = logging.getLogger("gridload")


class WindowDataset(Dataset):
    def __init__(self, series, covariates, lookback, horizon, stride=4):
        self.y = torch.from_numpy(series.astype(np.float32))
        self.c = torch.from_numpy(covariates.astype(np.float32))
        self.lookback, self.horizon = lookback, horizon
        self.starts = np.arange(0, len(series) - lookback - horizon, stride)

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, k):
        s = self.starts[k]
        e = s + self.lookback
        hist = torch.cat([self.y[s:e, None], self.c[s:e]], dim=1)
        fut_cov = self.c[e:e + self.horizon]
        return hist, fut_cov, self.y[e:e + self.horizon]


class Seq2SeqLSTM(nn.Module):
    def __init__(self, n_cov, hidden=256, layers=2, dropout=0.2):
        super().__init__()
        self.encoder = nn.LSTM(1 + n_cov, hidden, layers, batch_first=True, dropout=dropout)
        self.decoder = nn.LSTM(n_cov, hidden, layers, batch_first=True, dropout=dropout)
        self.head = nn.Sequential(nn.Linear(hidden, hidden // 2), nn.GELU(), nn.Linear(hidden // 2, 1))

    def forward(self, hist, fut_cov):
        _, state = self.encoder(hist)
        out, _ = self.decoder(fut_cov, state)
        return self.head(out).squeeze(-1)


# ----------------------------------------------------------------------- callbacks
class Callback:
    def on_train_epoch_end(self, trainer, logs): pass
    def on_validation_end(self, trainer, logs): pass


class ModelCheckpoint(Callback):
    """Keeps the k best checkpoints by `monitor` plus last.ckpt."""

    def __init__(self, dirpath, monitor="val_mae", save_top_k=3):
        self.dirpath = Path(dirpath)
        self.monitor, self.k = monitor, save_top_k
        self.heap = []  # (-score, path) so the worst is on top

    def on_validation_end(self, trainer, logs):
        self.dirpath.mkdir(parents=True, exist_ok=True)
        score = logs[self.monitor]
        path = self.dirpath / f"epoch={trainer.epoch:03d}-{self.monitor}={score:.4f}.ckpt"
        trainer.save_checkpoint(path)
        heapq.heappush(self.heap, (-score, str(path)))
        if len(self.heap) > self.k:
            _, worst = heapq.heappop(self.heap)
            os.remove(worst)
        trainer.save_checkpoint(self.dirpath / "last.ckpt")

    @property
    def best_path(self):
        return min(self.heap, key=lambda t: -t[0])[1] if self.heap else None


class EarlyStopping(Callback):
    def __init__(self, monitor="val_mae", patience=8, min_delta=1e-4):
        self.monitor, self.patience, self.min_delta = monitor, patience, min_delta
        self.best, self.wait = math.inf, 0

    def on_validation_end(self, trainer, logs):
        if logs[self.monitor] < self.best - self.min_delta:
            self.best, self.wait = logs[self.monitor], 0
        else:
            self.wait += 1
            if self.wait >= self.patience:
                trainer.should_stop = True


class LRLogger(Callback):
    def on_train_epoch_end(self, trainer, logs):
        logs["lr"] = trainer.optimizer.param_groups[0]["lr"]


# ----------------------------------------------------------------------- trainer
class Trainer:
    def __init__(self, model, optimizer, scheduler, device, callbacks, clip=1.0, max_epochs=50):
        self.device = device
        self.distributed = dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        model = model.to(device)
        self.model = DDP(model, device_ids=[device.index]) if self.distributed else model
        self.optimizer, self.scheduler = optimizer, scheduler
        self.callbacks, self.clip, self.max_epochs = callbacks, clip, max_epochs
        self.epoch, self.start_epoch, self.should_stop = 0, 0, False

    @property
    def module(self):
        return self.model.module if self.distributed else self.model

    def save_checkpoint(self, path):
        torch.save({"state_dict": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(), "epoch": self.epoch}, path)

    def _reduce_sum(self, t):
        if self.distributed:
            dist.all_reduce(t)
        return t

    def train_epoch(self, loader):
        self.model.train()
        acc = torch.zeros(2, device=self.device, dtype=torch.float64)
        for hist, fut, y in tqdm(loader, disable=self.rank != 0, leave=False):
            hist, fut, y = hist.to(self.device), fut.to(self.device), y.to(self.device)
            loss = nn.functional.huber_loss(self.model(hist, fut), y, delta=1.0)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
            self.optimizer.step()
            acc += torch.tensor([loss.item() * y.size(0), y.size(0)], device=self.device, dtype=torch.float64)
        self._reduce_sum(acc)
        return {"train_huber": (acc[0] / acc[1]).item()}

    @torch.no_grad()
    def validate(self, loader, scale):
        net = self.module
        net.eval()
        acc = torch.zeros(3, device=self.device, dtype=torch.float64)
        for hist, fut, y in loader:
            hist, fut, y = hist.to(self.device), fut.to(self.device), y.to(self.device)
            err = (net(hist, fut) - y) * scale
            acc += torch.stack([err.abs().sum().double(), (err ** 2).sum().double(),
                                torch.tensor(float(err.numel()), device=self.device, dtype=torch.float64)])
        self._reduce_sum(acc)
        return {"val_mae": (acc[0] / acc[2]).item(), "val_rmse": math.sqrt((acc[1] / acc[2]).item())}

    def fit(self, train_loader, val_loader, scale):
        for epoch in range(self.start_epoch, self.max_epochs):
            self.epoch = epoch
            if self.distributed:
                train_loader.sampler.set_epoch(epoch)
            logs = self.train_epoch(train_loader)
            for cb in self.callbacks:
                cb.on_train_epoch_end(self, logs)
            logs.update(self.validate(val_loader, scale))
            self.scheduler.step(logs["val_mae"])
            if self.rank == 0:
                logger.info("epoch %d: %s", epoch, ", ".join(f"{k}={v:.4f}" for k, v in logs.items()))
            for cb in self.callbacks:
                cb.on_validation_end(self, logs)
            if self.should_stop:
                break


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--lookback", type=int, default=672)
    ap.add_argument("--horizon", type=int, default=96)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--val-start", default="2023-01-01")
    ap.add_argument("--ckpt-dir", default="checkpoints/gridload")
    args = ap.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        dist.init_process_group("nccl")
    rank = dist.get_rank() if dist.is_initialized() else 0
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    device = torch.device("cuda", local_rank)

    df = pd.read_parquet(args.data).set_index("timestamp").sort_index()
    ts = df.index
    cov = np.stack([np.sin(2 * np.pi * ts.hour / 24), np.cos(2 * np.pi * ts.hour / 24),
                    np.sin(2 * np.pi * ts.dayofweek / 7), np.cos(2 * np.pi * ts.dayofweek / 7),
                    np.sin(2 * np.pi * ts.dayofyear / 365.25), np.cos(2 * np.pi * ts.dayofyear / 365.25),
                    df["is_holiday"].values, (df["temp_c"].values - 12.0) / 10.0], axis=1)
    split = int(np.searchsorted(ts, pd.Timestamp(args.val_start)))
    mu, sigma = df["load_mw"].values[:split].mean(), df["load_mw"].values[:split].std()
    y = (df["load_mw"].values - mu) / sigma
    train_ds = WindowDataset(y[:split], cov[:split], args.lookback, args.horizon)
    val_ds = WindowDataset(y[split - args.lookback:], cov[split - args.lookback:], args.lookback, args.horizon,
                           stride=args.horizon)

    world = dist.get_world_size() if dist.is_initialized() else 1
    sampler = DistributedSampler(train_ds, shuffle=True) if dist.is_initialized() else None
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, shuffle=sampler is None,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)),
                            batch_size=512, num_workers=2)

    torch.manual_seed(0)
    model = Seq2SeqLSTM(n_cov=cov.shape[1])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=3)
    ckpt_cb = ModelCheckpoint(args.ckpt_dir)
    trainer = Trainer(model, optimizer, scheduler, device, [LRLogger(), ckpt_cb, EarlyStopping()],
                      max_epochs=args.epochs)
    trainer.fit(train_loader, val_loader, scale=float(sigma))

    if rank == 0:
        logger.info("best checkpoint: %s", ckpt_cb.best_path)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
