#!/usr/bin/env python
# coding: utf-8

# # Fashion-MNIST - multi GPU training with DDP
# Exported from the Kaggle notebook (2x T4). Run as a script:
#     python 03_fashion_mnist_kaggle.py

# In[1]:


import os
import time
import random

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler


# In[2]:


CFG = {
    "train_csv": "/kaggle/input/fashionmnist/fashion-mnist_train.csv",
    "test_csv": "/kaggle/input/fashionmnist/fashion-mnist_test.csv",
    "epochs": 20,
    "batch_size": 128,     # per GPU
    "lr": 1e-3,
    "weight_decay": 1e-4,
    "seed": 2023,
    "num_workers": 2,
    "out_dir": "/kaggle/working",
}


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


# In[3]:


class FashionCSV(Dataset):
    def __init__(self, csv_path, train=True):
        df = pd.read_csv(csv_path)
        self.labels = df["label"].values.astype(np.int64)
        self.images = df.drop(columns=["label"]).values.astype(np.float32).reshape(-1, 1, 28, 28) / 255.0
        self.train = train

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, idx):
        img = torch.from_numpy(self.images[idx])
        if self.train and random.random() < 0.5:
            img = torch.flip(img, dims=[2])
        img = (img - 0.2860) / 0.3530
        return img, self.labels[idx]


# In[4]:


class FashionCNN(nn.Module):
    def __init__(self, n_classes=10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(inplace=True),
            nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
            nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Dropout(0.25),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(64 * 7 * 7, 256), nn.ReLU(inplace=True), nn.Dropout(0.5),
            nn.Linear(256, n_classes),
        )

    def forward(self, x):
        return self.classifier(self.features(x))


# In[5]:


def ddp_setup(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "29500"
    torch.cuda.set_device(rank)
    dist.init_process_group(backend="nccl", rank=rank, world_size=world_size)


def reduce_sum(t):
    t = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def run_epoch(model, loader, optimizer, device, train=True):
    model.train(train)
    totals = torch.zeros(3, device=device)
    with torch.set_grad_enabled(train):
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            if train:
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            totals[0] += loss.detach() * y.size(0)
            totals[1] += (logits.argmax(1) == y).sum()
            totals[2] += y.size(0)
    totals = reduce_sum(totals)
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


# In[6]:


def main(rank, world_size):
    ddp_setup(rank, world_size)
    seed_everything(CFG["seed"])
    device = torch.device(f"cuda:{rank}")

    train_ds = FashionCSV(CFG["train_csv"], train=True)
    test_ds = FashionCSV(CFG["test_csv"], train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    test_sampler = DistributedSampler(test_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=CFG["batch_size"], sampler=train_sampler,
                          num_workers=CFG["num_workers"], pin_memory=True, drop_last=True)
    test_dl = DataLoader(test_ds, batch_size=256, sampler=test_sampler,
                         num_workers=CFG["num_workers"], pin_memory=True)

    model = FashionCNN().to(device)
    model = DDP(model, device_ids=[rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=CFG["lr"] * world_size,
                                  weight_decay=CFG["weight_decay"])
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=CFG["epochs"])

    best_acc = 0.0
    for epoch in range(CFG["epochs"]):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        tr_loss, tr_acc = run_epoch(model, train_dl, optimizer, device, train=True)
        va_loss, va_acc = run_epoch(model, test_dl, optimizer, device, train=False)
        scheduler.step()
        if rank == 0:
            print(f"[{epoch + 1:02d}/{CFG['epochs']}] train loss {tr_loss:.4f} acc {tr_acc:.4f} | "
                  f"val loss {va_loss:.4f} acc {va_acc:.4f} | {time.time() - t0:.1f}s")
            if va_acc > best_acc:
                best_acc = va_acc
                torch.save(model.module.state_dict(), os.path.join(CFG["out_dir"], "fashion_cnn_best.pth"))

    if rank == 0:
        print("best val acc:", best_acc)
    dist.destroy_process_group()


# In[7]:


world_size = torch.cuda.device_count()
print(f"Training on {world_size} GPUs")
mp.spawn(main, args=(world_size,), nprocs=world_size, join=True)

