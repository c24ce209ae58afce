"""Human-activity recognition (accelerometer windows) with a Conv1D + GRU network.

We kept a thin Keras-like base class (summary / save_weights / load_weights /
get_config) so the serving side, which loads `*.weights.pt` + `config.json`,
did not have to change when we left TensorFlow.

    torchrun --standalone --nproc_per_node=4 07_har_keraslike_module.py --data data/har_windows.npz
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class KerasLikeModule(nn.Module):
    def get_config(self):
        return dict(self._config)

    def summary(self, print_fn=print):
        print_fn(f'Model: "{type(self).__name__}"')
        print_fn("_" * 64)
        print_fn(f"{'Layer (type)':<40}{'Param #':>24}")
        print_fn("=" * 64)
        total = 0
        for name, mod in self.named_children():
            n = sum(p.numel() for p in mod.parameters())
            total += n
            print_fn(f"{name + ' (' + type(mod).__name__ + ')':<40}{n:>24,}")
        print_fn("=" * 64)
        print_fn(f"Total params: {total:,}")

    def save_weights(self, filepath):
        torch.save(self.state_dict(), filepath)

    def load_weights(self, filepath, map_location="cpu"):
        self.load_state_dict(torch.load(filepath, map_location=map_location))


class ConvGRUClassifier(KerasLikeModule):
    def __init__(self, n_channels=6, n_classes=6, conv_filters=64, gru_units=128, dropout=0.3):
        super().__init__()
        self._config = dict(n_channels=n_channels, n_classes=n_classes, conv_filters=conv_filters,
                            gru_units=gru_units, dropout=dropout)
        self.conv1 = nn.Conv1d(n_channels, conv_filters, 5, padding=2)
        self.bn1 = nn.BatchNorm1d(conv_filters)
        self.conv2 = nn.Conv1d(conv_filters, conv_filters, 5, padding=2)
        self.bn2 = nn.BatchNorm1d(conv_filters)
        self.gru = nn.GRU(conv_filters, gru_units, batch_first=True, bidirectional=True)
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(2 * gru_units, n_classes)

    def forward(self, x):  # x: (B, T, C) as in the Keras input_shape
        h = x.transpose(1, 2)
        h = F.relu(self.bn1(self.conv1(h)))
        h = F.max_pool1d(F.relu(self.bn2(self.conv2(h))), 2)
        out, _ = self.gru(h.transpose(1, 2))
        return self.classifier(self.dropout(out.mean(dim=1)))


class ModelCheckpoint:
    def __init__(self, model, directory, monitor="val_accuracy"):
        self.model, self.directory, self.monitor = model, directory, monitor
        self.best = -1.0

    def on_epoch_end(self, epoch, logs):
        if logs[self.monitor] > self.best:
            self.best = logs[self.monitor]
            self.model.save_weights(os.path.join(self.directory, "best.weights.pt"))
            print(f"\nEpoch {epoch + 1}: {self.monitor} improved to {self.best:.4f}, saving model")


class EarlyStopping:
    def __init__(self, monitor="val_loss", patience=8):
        self.monitor, self.patience = monitor, patience
        self.best, self.wait, self.stop_training = float("inf"), 0, False

    def on_epoch_end(self, epoch, logs):
        if logs[self.monitor] < self.best - 1e-4:
            self.best, self.wait = logs[self.monitor], 0
        else:
            self.wait += 1
            self.stop_training = self.wait >= self.patience


def all_reduce_sum(values, device):
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def run_epoch(model, loader, device, optimizer=None):
    training = optimizer is not None
    model.train(training)
    loss_sum, correct, n = 0.0, 0, 0
    with torch.set_grad_enabled(training):
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            if training:
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
            loss_sum += loss.item() * y.size(0)
            correct += (logits.argmax(1) == y).sum().item()
            n += y.size(0)
    loss_sum, correct, n = all_reduce_sum([loss_sum, correct, n], device)
    return loss_sum / n, correct / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/har_windows.npz")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--model-dir", default="models/har_convgru")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    d = np.load(args.data)
    x_train, y_train = torch.from_numpy(d["x_train"]).float(), torch.from_numpy(d["y_train"]).long()
    x_test, y_test = torch.from_numpy(d["x_test"]).float(), torch.from_numpy(d["y_test"]).long()
    mean, std = x_train.mean(dim=(0, 1)), x_train.std(dim=(0, 1))
    train_ds = TensorDataset((x_train - mean) / std, y_train)
    test_ds = TensorDataset((x_test - mean) / std, y_test)

    sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                              num_workers=2, pin_memory=True)
    test_loader = DataLoader(Subset(test_ds, range(rank, len(test_ds), world)), batch_size=512,
                             num_workers=2, pin_memory=True)

    net = ConvGRUClassifier(n_channels=x_train.shape[-1], n_classes=int(y_train.max()) + 1)
    if rank == 0:
        os.makedirs(args.model_dir, exist_ok=True)
        net.summary()
        with open(os.path.join(args.model_dir, "config.json"), "w") as f:
            json.dump(net.get_config(), f, indent=2)
        np.savez(os.path.join(args.model_dir, "norm.npz"), mean=mean.numpy(), std=std.numpy())
    model = DDP(net.to(device), device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * world)

    early = EarlyStopping("val_loss", patience=8)
    ckpt = ModelCheckpoint(model, args.model_dir, monitor="val_accuracy")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        loss, acc = run_epoch(model, train_loader, device, optimizer)
        val_loss, val_acc = run_epoch(model, test_loader, device)
        logs = dict(loss=loss, accuracy=acc, val_loss=val_loss, val_accuracy=val_acc)
        if rank == 0:
            print(f"Epoch {epoch + 1}/{args.epochs} - {time.time() - t0:.1f}s - "
                  + " - ".join(f"{k}: {v:.4f}" for k, v in logs.items()), flush=True)
            ckpt.on_epoch_end(epoch, logs)
        early.on_epoch_end(epoch, logs)
        if early.stop_training:
            break

    dist.barrier()
    if rank == 0:
        net.load_weights(os.path.join(args.model_dir, "best.weights.pt"))
        print("restored best weights")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
