"""TextCNN sentiment classifier (IMDB / SST style), multi-GPU.

Port of keras_textcnn.py. The Trainer mirrors the Keras API we had:
compile() -> fit() -> evaluate(), with callbacks receiving a `logs` dict.

    torchrun --standalone --nproc_per_node=4 02_textcnn_trainer_fit.py --data data/imdb_tok.pt
"""
import argparse
import csv
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/imdb_tok.pt", help="dict with train_ids/train_y/test_ids/test_y/vocab_size")
    ap.add_argument("--embed-dim", type=int, default=300)
    ap.add_argument("--filters", type=int, default=128)
    ap.add_argument("--kernel-sizes", default="3,4,5")
    ap.add_argument("--dropout", type=float, default=0.5)
    ap.add_argument("--batch-size", type=int, default=64, help="per replica")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--patience", type=int, default=3)
    ap.add_argument("--out", default="runs/textcnn")
    return ap.parse_args()


class TextCNN(nn.Module):
    def __init__(self, vocab_size, embed_dim, filters, kernel_sizes, num_classes=2, dropout=0.5):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed_dim, padding_idx=0)
        self.convs = nn.ModuleList([nn.Conv1d(embed_dim, filters, k) for k in kernel_sizes])
        self.dropout = nn.Dropout(dropout)
        self.dense = nn.Linear(filters * len(kernel_sizes), num_classes)

    def forward(self, ids):
        x = self.embedding(ids).transpose(1, 2)  # (B, E, L)
        pooled = [F.relu(conv(x)).amax(dim=2) for conv in self.convs]
        return self.dense(self.dropout(torch.cat(pooled, dim=1)))


class Metric:
    """Minimal tf.keras.metrics.Metric replacement that reduces across replicas."""

    def __init__(self, name, device):
        self.name = name
        self.total = torch.zeros((), dtype=torch.float64, device=device)
        self.count = torch.zeros((), dtype=torch.float64, device=device)

    def reset_state(self):
        self.total.zero_()
        self.count.zero_()

    def result(self):
        buf = torch.stack([self.total, self.count])
        dist.all_reduce(buf, op=dist.ReduceOp.SUM)
        return (buf[0] / buf[1].clamp(min=1)).item()


class MeanLoss(Metric):
    def update_state(self, loss, n):
        self.total += loss.detach().double() * n
        self.count += n


class BinaryAccuracy(Metric):
    def update_state(self, logits, y):
        self.total += (logits.argmax(-1) == y).sum().double()
        self.count += y.numel()


class CSVLogger:
    def __init__(self, path):
        self.path = path
        self.writer = None

    def on_epoch_end(self, epoch, logs):
        new = self.writer is None
        if new:
            self.fh = open(self.path, "w", newline="")
            self.writer = csv.DictWriter(self.fh, fieldnames=["epoch"] + list(logs))
            self.writer.writeheader()
        self.writer.writerow({"epoch": epoch, **logs})
        self.fh.flush()


class EarlyStopping:
    def __init__(self, monitor="val_loss", patience=3, mode="min"):
        self.monitor, self.patience, self.mode = monitor, patience, mode
        self.best = math.inf if mode == "min" else -math.inf
        self.wait = 0
        self.stop = False

    def on_epoch_end(self, epoch, logs):
        cur = logs[self.monitor]
        better = cur < self.best if self.mode == "min" else cur > self.best
        if better:
            self.best, self.wait = cur, 0
        else:
            self.wait += 1
            if self.wait >= self.patience:
                self.stop = True


class Trainer:
    def __init__(self, model, device, rank, out_dir):
        self.model = model
        self.device = device
        self.rank = rank
        self.out_dir = out_dir

    def compile(self, optimizer, loss_fn):
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.metrics = [MeanLoss("loss", self.device), BinaryAccuracy("accuracy", self.device)]
        self.val_metrics = [MeanLoss("val_loss", self.device), BinaryAccuracy("val_accuracy", self.device)]

    def train_step(self, ids, y):
        logits = self.model(ids)
        loss = self.loss_fn(logits, y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(self.model.parameters(), 5.0)
        self.optimizer.step()
        self.metrics[0].update_state(loss, y.size(0))
        self.metrics[1].update_state(logits, y)

    @torch.no_grad()
    def evaluate(self, loader):
        self.model.eval()
        for m in self.val_metrics:
            m.reset_state()
        for ids, y in loader:
            ids, y = ids.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            logits = self.model(ids)
            self.val_metrics[0].update_state(self.loss_fn(logits, y), y.size(0))
            self.val_metrics[1].update_state(logits, y)
        return {m.name: m.result() for m in self.val_metrics}

    def fit(self, train_loader, val_loader, epochs, callbacks=()):
        history = []
        best = -1.0
        for epoch in range(epochs):
            self.model.train()
            for m in self.metrics:
                m.reset_state()
            t0 = time.time()
            for ids, y in train_loader:
                ids, y = ids.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
                self.train_step(ids, y)
            logs = {m.name: m.result() for m in self.metrics}
            logs.update(self.evaluate(val_loader))
            history.append(logs)

            if self.rank == 0:
                print(f"Epoch {epoch + 1}/{epochs} [{time.time() - t0:.1f}s] "
                      + " ".join(f"{k}={v:.4f}" for k, v in logs.items()), flush=True)
                if logs["val_accuracy"] > best:
                    best = logs["val_accuracy"]
                    torch.save(self.model.module.state_dict(), os.path.join(self.out_dir, "best.pt"))
            for cb in callbacks:
                cb.on_epoch_end(epoch, logs)
            if any(getattr(cb, "stop", False) for cb in callbacks):
                break
        return history


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    blob = torch.load(args.data, map_location="cpu")
    train_ds = TensorDataset(blob["train_ids"].long(), blob["train_y"].long())
    val_ds = TensorDataset(blob["test_ids"].long(), blob["test_y"].long())

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=1234)
    # strided shard of the test set, no padding (the padded sampler double counts a few reviews)
    val_shard = Subset(val_ds, range(rank, len(val_ds), world_size))
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=2, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_shard, batch_size=256, shuffle=False, num_workers=2, pin_memory=True)

    kernel_sizes = [int(k) for k in args.kernel_sizes.split(",")]
    net = TextCNN(blob["vocab_size"], args.embed_dim, args.filters, kernel_sizes, dropout=args.dropout)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(net)
        print(f"Trainable params: {sum(p.numel() for p in net.parameters() if p.requires_grad):,}")
        print(f"Replicas: {world_size}, global batch: {args.batch_size * world_size}")
    model = DDP(net.to(device), device_ids=[local_rank])

    trainer = Trainer(model, device, rank, args.out)
    trainer.compile(torch.optim.Adam(model.parameters(), lr=args.lr), nn.CrossEntropyLoss())
    callbacks = [EarlyStopping("val_loss", patience=args.patience)]
    if rank == 0:
        callbacks.append(CSVLogger(os.path.join(args.out, "history.csv")))
    trainer.fit(train_loader, val_loader, args.epochs, callbacks)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
