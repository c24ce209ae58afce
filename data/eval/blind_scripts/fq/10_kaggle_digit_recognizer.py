#!/usr/bin/env python
# coding: utf-8

# # Digit Recognizer - DDP on Kaggle 2xT4
#
# Notebook exported to a script. Functions defined in a notebook cannot be pickled for
# the 'spawn' start method, so the workers are started with 'fork'.

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


DATA_DIR = "/kaggle/input/digit-recognizer"
OUT_DIR = "/kaggle/working"
EPOCHS = 30
BATCH_SIZE = 128          # per GPU
LR = 1e-3
SEED = 42
VAL_FRAC = 0.1


def seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


print(torch.__version__)
print("GPUs:", torch.cuda.device_count())


# In[3]:


train_df = pd.read_csv(os.path.join(DATA_DIR, "train.csv"))
test_df = pd.read_csv(os.path.join(DATA_DIR, "test.csv"))
print(train_df.shape, test_df.shape)

rng = np.random.RandomState(SEED)
perm = rng.permutation(len(train_df))
n_val = int(len(train_df) * VAL_FRAC)
val_idx, tr_idx = perm[:n_val], perm[n_val:]

X_all = train_df.drop(columns=["label"]).values.astype(np.float32).reshape(-1, 1, 28, 28) / 255.0
y_all = train_df["label"].values.astype(np.int64)
X_test = test_df.values.astype(np.float32).reshape(-1, 1, 28, 28) / 255.0


# In[4]:


class DigitDataset(Dataset):
    def __init__(self, X, y=None, augment=False):
        self.X, self.y, self.augment = X, y, augment

    def __len__(self):
        return len(self.X)

    def __getitem__(self, i):
        x = torch.from_numpy(self.X[i])
        if self.augment:
            dx, dy = np.random.randint(-2, 3, size=2)
            x = torch.roll(x, shifts=(int(dy), int(dx)), dims=(1, 2))
        x = (x - 0.1307) / 0.3081
        if self.y is None:
            return x
        return x, self.y[i]


class DigitNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.block1 = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.MaxPool2d(2), nn.Dropout(0.2))
        self.block2 = nn.Sequential(
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
            nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
            nn.MaxPool2d(2), nn.Dropout(0.3))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64 * 7 * 7, 256), nn.ReLU(),
                                  nn.Dropout(0.4), nn.Linear(256, 10))

    def forward(self, x):
        return self.head(self.block2(self.block1(x)))


# In[5]:


# quick sanity check of the model on one GPU before launching the multi-GPU job
_m = DigitNet().cuda()
print(_m(torch.randn(4, 1, 28, 28).cuda()).shape)
del _m
torch.cuda.empty_cache()


# In[6]:


def train_fn(rank, world_size):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = "29522"
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    seed_all(SEED)
    device = torch.device("cuda", rank)

    train_ds = DigitDataset(X_all[tr_idx], y_all[tr_idx], augment=True)
    val_ds = DigitDataset(X_all[val_idx], y_all[val_idx])
    tr_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    va_sampler = DistributedSampler(val_ds, num_replicas=world_size, rank=rank, shuffle=False)
    tr_dl = DataLoader(train_ds, batch_size=BATCH_SIZE, sampler=tr_sampler, num_workers=2, drop_last=True)
    va_dl = DataLoader(val_ds, batch_size=512, sampler=va_sampler, num_workers=2)

    model = DDP(DigitNet().to(device), device_ids=[rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=LR * world_size)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=LR * world_size,
                                                    epochs=EPOCHS, steps_per_epoch=len(tr_dl))

    best_acc = 0.0
    for epoch in range(EPOCHS):
        tr_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in tr_dl:
            x, y = x.to(device), y.to(device)
            loss = F.cross_entropy(model(x), y, label_smoothing=0.05)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()

        model.eval()
        stats = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in va_dl:
                x, y = x.to(device), y.to(device)
                stats[0] += (model(x).argmax(1) == y).sum()
                stats[1] += y.numel()
        dist.all_reduce(stats)
        acc = (stats[0] / stats[1]).item()
        if rank == 0:
            print(f"epoch {epoch + 1:02d} val acc {acc:.4f} ({time.time() - t0:.1f}s)")
            if acc > best_acc:
                best_acc = acc
                torch.save(model.module.state_dict(), os.path.join(OUT_DIR, "digitnet.pth"))
        dist.barrier()

    dist.destroy_process_group()


# In[7]:


def predict_test():
    model = DigitNet()
    model.load_state_dict(torch.load(os.path.join(OUT_DIR, "digitnet.pth"), map_location="cpu"))
    model = model.cuda().eval()
    dl = DataLoader(DigitDataset(X_test), batch_size=1024)
    preds = []
    with torch.no_grad():
        for x in dl:
            preds.append(model(x.cuda()).argmax(1).cpu())
    preds = torch.cat(preds).numpy()
    sub = pd.DataFrame({"ImageId": np.arange(1, len(preds) + 1), "Label": preds})
    sub.to_csv(os.path.join(OUT_DIR, "submission.csv"), index=False)
    print(sub.head())


# In[8]:


if __name__ == "__main__":
    world_size = torch.cuda.device_count()
    mp.start_processes(train_fn, args=(world_size,), nprocs=world_size, join=True, start_method="fork")
    predict_test()
