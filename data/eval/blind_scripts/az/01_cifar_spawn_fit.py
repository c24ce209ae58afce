#!/usr/bin/env python
"""CIFAR-10 ResNet-20, ported from our tf.distribute.MirroredStrategy notebook.

The Keras version used strategy.scope() + model.fit(); this keeps the same
fit()/callbacks shape but runs one process per GPU via mp.spawn.

    python 01_cifar_spawn_fit.py --gpus 4 --per-replica-batch 128
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Sampler
from torch.utils.data.distributed import DistributedSampler

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", default="./data")
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--per-replica-batch", type=int, default=128)
    p.add_argument("--base-lr", type=float, default=0.1, help="lr for a global batch of 256")
    p.add_argument("--epochs", type=int, default=160)
    p.add_argument("--steps-per-epoch", type=int, default=0, help="0 = one pass over the shard")
    p.add_argument("--patience", type=int, default=20)
    p.add_argument("--ckpt", default="checkpoints/cifar_resnet20.pt")
    p.add_argument("--port", default="29511")
    return p.parse_args()


class ShardSampler(Sampler):
    """Dataset.shard(num_shards, index) without padding: each val sample is seen once."""

    def __init__(self, n, rank, world_size):
        self.indices = list(range(rank, n, world_size))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


def repeat(loader, sampler):
    """tf.data .repeat(): endless stream, reshuffled on every pass."""
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for batch in loader:
            yield batch
        epoch += 1


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.short = None
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.b1(self.c1(x)))
        out = self.b2(self.c2(out))
        return F.relu(out + (x if self.short is None else self.short(x)))


class ResNet20(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True))
        layers, cin = [], 16
        for cout, stride in [(16, 1), (32, 2), (64, 2)]:
            for i in range(3):
                layers.append(BasicBlock(cin, cout, stride if i == 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class Mean:
    def __init__(self, name, device):
        self.name = name
        self.state = torch.zeros(2, device=device)

    def update_state(self, value, n):
        self.state[0] += value.detach() * n
        self.state[1] += n

    def result(self):
        s = self.state.clone()
        dist.all_reduce(s)
        return (s[0] / s[1].clamp(min=1)).item()

    def reset_state(self):
        self.state.zero_()


class Accuracy(Mean):
    def update_state(self, logits, y):
        self.state[0] += (logits.argmax(1) == y).sum()
        self.state[1] += y.numel()


class EarlyStopping:
    def __init__(self, monitor="val_loss", patience=10):
        self.monitor, self.patience = monitor, patience
        self.best, self.wait, self.stop_training = math.inf, 0, False

    def on_epoch_end(self, epoch, logs):
        if logs[self.monitor] < self.best:
            self.best, self.wait = logs[self.monitor], 0
        else:
            self.wait += 1
            self.stop_training = self.wait >= self.patience


class ModelCheckpoint:
    def __init__(self, path, model, monitor="val_acc", rank=0):
        self.path, self.model, self.monitor, self.rank = path, model, monitor, rank
        self.best = -math.inf

    def on_epoch_end(self, epoch, logs):
        if logs[self.monitor] > self.best:
            self.best = logs[self.monitor]
            if self.rank == 0:
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                torch.save({"epoch": epoch, "model": self.model.module.state_dict(), "logs": logs}, self.path)


def worker(rank, world_size, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = args.port
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(0)

    train_tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)])
    val_tf = T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)])
    # download=False: main() fetched the data once before spawning
    train_ds = torchvision.datasets.CIFAR10(args.data_dir, train=True, transform=train_tf, download=False)
    val_ds = torchvision.datasets.CIFAR10(args.data_dir, train=False, transform=val_tf, download=False)

    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.per_replica_batch, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=256, sampler=ShardSampler(len(val_ds), rank, world_size),
                            num_workers=2, pin_memory=True)

    model = ResNet20()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[rank], output_device=rank)

    global_batch = args.per_replica_batch * world_size
    lr = args.base_lr * global_batch / 256
    steps_per_epoch = args.steps_per_epoch or len(train_loader)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=args.epochs * steps_per_epoch,
                                                    pct_start=0.05)
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"ResNet20: {n_params:,} params | replicas={world_size} global_batch={global_batch} lr={lr:.3f}")

    loss_m, acc_m = Mean("loss", device), Accuracy("acc", device)
    vloss_m, vacc_m = Mean("val_loss", device), Accuracy("val_acc", device)
    callbacks = [EarlyStopping("val_loss", args.patience), ModelCheckpoint(args.ckpt, model, "val_acc", rank)]
    stream = repeat(train_loader, train_sampler)

    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for m in (loss_m, acc_m, vloss_m, vacc_m):
            m.reset_state()
        for step in range(steps_per_epoch):
            x, y = next(stream)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            loss = F.cross_entropy(logits, y, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            loss_m.update_state(loss, y.size(0))
            acc_m.update_state(logits.detach(), y)

        model.eval()
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                logits = model(x)
                vloss_m.update_state(F.cross_entropy(logits, y), y.size(0))
                vacc_m.update_state(logits, y)

        logs = {m.name: m.result() for m in (loss_m, acc_m, vloss_m, vacc_m)}
        if rank == 0:
            print(f"Epoch {epoch + 1}/{args.epochs} - {time.time() - t0:.0f}s - "
                  + " - ".join(f"{k}: {v:.4f}" for k, v in logs.items()), flush=True)
        for cb in callbacks:
            cb.on_epoch_end(epoch, logs)
        if any(getattr(cb, "stop_training", False) for cb in callbacks):
            if rank == 0:
                print(f"Early stopping at epoch {epoch + 1}")
            break

    dist.barrier()
    dist.destroy_process_group()


def main():
    args = parse_args()
    torchvision.datasets.CIFAR10(args.data_dir, train=True, download=True)
    torchvision.datasets.CIFAR10(args.data_dir, train=False, download=True)
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
