#!/usr/bin/env python
# coding: utf-8
# Bengali.AI Handwritten Grapheme Classification
# (exported from the kaggle kernel; run on the workstation with all GPUs: `python 13_bengali_grapheme_spawn.py`)

import os
import random
import time

import cv2
import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from sklearn.metrics import recall_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

# In[1]:
DATA = "/data/bengaliai-cv19"
OUT = "./bengali_se_resnext50"
ARCH = "seresnext50_32x4d"
HEIGHT, WIDTH = 137, 236
SIZE = 128
N_ROOT, N_VOWEL, N_CONS = 168, 11, 7
EPOCHS = 40
BATCH = 128
LR = 1e-3
FOLD = 0
CUTMIX_P = 0.5
SEED = 2020
PORT = 29577


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


# In[2]:
def crop_resize(img, size=SIZE, pad=16):
    ymin, ymax, xmin, xmax = 0, img.shape[0], 0, img.shape[1]
    rows = np.where(np.any(img > 80, axis=1))[0]
    cols = np.where(np.any(img > 80, axis=0))[0]
    if len(rows) and len(cols):
        ymin, ymax, xmin, xmax = rows[0], rows[-1], cols[0], cols[-1]
    img = img[max(ymin - 10, 0):ymax + 10, max(xmin - 13, 0):xmax + 13]
    img[img < 28] = 0
    ly, lx = ymax - ymin, xmax - xmin
    l = max(lx, ly) + pad
    img = np.pad(img, [((l - img.shape[0]) // 2,), ((l - img.shape[1]) // 2,)], mode="constant")
    return cv2.resize(img, (size, size))


class GraphemeDS(Dataset):
    def __init__(self, images, labels, rows, train):
        self.images, self.labels, self.rows, self.train = images, labels, rows, train

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        j = self.rows[i]
        img = 255 - self.images[j].reshape(HEIGHT, WIDTH)
        img = crop_resize(img).astype(np.float32) / 255.0
        if self.train and random.random() < 0.5:
            m = cv2.getRotationMatrix2D((SIZE / 2, SIZE / 2), random.uniform(-12, 12), random.uniform(0.9, 1.1))
            img = cv2.warpAffine(img, m, (SIZE, SIZE))
        img = (img - 0.0692) / 0.2051
        return torch.from_numpy(img[None]), torch.from_numpy(self.labels[j]), i


class GraphemeNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = timm.create_model(ARCH, pretrained=True, in_chans=1, num_classes=0)
        nf = self.body.num_features
        self.root = nn.Linear(nf, N_ROOT)
        self.vowel = nn.Linear(nf, N_VOWEL)
        self.cons = nn.Linear(nf, N_CONS)

    def forward(self, x):
        f = self.body(x)
        return self.root(f), self.vowel(f), self.cons(f)


def cutmix(x, y, alpha=1.0):
    lam = np.random.beta(alpha, alpha)
    perm = torch.randperm(x.size(0), device=x.device)
    cut = np.sqrt(1 - lam)
    h, w = int(SIZE * cut), int(SIZE * cut)
    cy, cx = np.random.randint(SIZE), np.random.randint(SIZE)
    y1, y2, x1, x2 = np.clip(cy - h // 2, 0, SIZE), np.clip(cy + h // 2, 0, SIZE), np.clip(cx - w // 2, 0, SIZE), np.clip(cx + w // 2, 0, SIZE)
    x[:, :, y1:y2, x1:x2] = x[perm, :, y1:y2, x1:x2]
    lam = 1 - (y2 - y1) * (x2 - x1) / (SIZE * SIZE)
    return x, y, y[perm], lam


def grapheme_recall(y, p):
    scores = [recall_score(y[:, k], p[:, k], average="macro", zero_division=0) for k in range(3)]
    return np.average(scores, weights=[2, 1, 1]), scores


def predict(net, loader, device):
    net.eval()
    idx, preds = [], []
    with torch.no_grad(), torch.cuda.amp.autocast():
        for x, _, i in loader:
            r, v, c = net(x.to(device))
            preds.append(torch.stack([r.argmax(1), v.argmax(1), c.argmax(1)], 1).cpu().numpy())
            idx.append(i.numpy())
    local = (np.concatenate(idx), np.concatenate(preds)) if preds else (np.zeros(0, int), np.zeros((0, 3), int))
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, local)
    idx = np.concatenate([o[0] for o in out])
    preds = np.concatenate([o[1] for o in out])
    order = np.argsort(idx)
    return idx[order], preds[order]


# In[3]:
def train_worker(rank, world_size):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{PORT}", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    seed_everything(SEED)
    images, labels, folds = load_data()

    tr_idx, va_idx = np.where(folds != FOLD)[0], np.where(folds == FOLD)[0]
    tr_ds = GraphemeDS(images, labels, tr_idx, train=True)
    va_ds = GraphemeDS(images, labels, va_idx, train=False)
    sampler = DistributedSampler(tr_ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    tr_dl = DataLoader(tr_ds, batch_size=BATCH, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    # plain strided shard for validation: no padding, each rank simply gets fewer or more rows
    va_dl = DataLoader(Subset(va_ds, list(range(rank, len(va_ds), world_size))), batch_size=BATCH * 2, num_workers=4)

    model = GraphemeNet()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[rank])
    opt = torch.optim.Adam(model.parameters(), lr=LR * world_size ** 0.5)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=EPOCHS * len(tr_dl), eta_min=1e-6)
    scaler = torch.cuda.amp.GradScaler()
    ce = nn.CrossEntropyLoss()
    w = (0.5, 0.25, 0.25)
    ckpt = os.path.join(OUT, f"{ARCH}_fold{FOLD}.pth")

    best = 0.0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y, _ in tr_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            use_cm = np.random.rand() < CUTMIX_P
            with torch.cuda.amp.autocast():
                if use_cm:
                    x, ya, yb, lam = cutmix(x, y)
                    outs = model(x)
                    loss = sum(wk * (lam * ce(o, ya[:, k]) + (1 - lam) * ce(o, yb[:, k]))
                               for k, (wk, o) in enumerate(zip(w, outs)))
                else:
                    outs = model(x)
                    loss = sum(wk * ce(o, y[:, k]) for k, (wk, o) in enumerate(zip(w, outs)))
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()

        idx, pred = predict(model.module, va_dl, device)
        score, parts = grapheme_recall(labels[va_idx][idx], pred)
        if rank == 0:
            print(f"epoch {epoch} recall {score:.4f} (root {parts[0]:.4f} vowel {parts[1]:.4f} cons {parts[2]:.4f}) "
                  f"{time.time() - t0:.0f}s", flush=True)
            if score > best:
                best = score
                torch.save(model.module.state_dict(), ckpt)
        dist.barrier()

    # out-of-fold predictions from the best epoch
    state = torch.load(ckpt, map_location={"cuda:0": f"cuda:{rank}"})
    model.module.load_state_dict(state)
    idx, pred = predict(model.module, va_dl, device)
    if rank == 0:
        oof = pd.DataFrame(pred, columns=["grapheme_root", "vowel_diacritic", "consonant_diacritic"])
        oof.insert(0, "row", va_idx[idx])
        oof.to_csv(os.path.join(OUT, f"oof_fold{FOLD}.csv"), index=False)
        print(f"best recall {best:.4f}, oof written", flush=True)
    dist.destroy_process_group()


# In[4]:
def load_data():
    train = pd.read_csv(os.path.join(DATA, "train_folds.csv"))
    images = np.concatenate([
        pd.read_parquet(os.path.join(DATA, f"train_image_data_{k}.parquet")).iloc[:, 1:].values.astype(np.uint8)
        for k in range(4)
    ])
    labels = train[["grapheme_root", "vowel_diacritic", "consonant_diacritic"]].values.astype(np.int64)
    return images, labels, train.fold.values


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    world_size = torch.cuda.device_count()
    print(f"training fold {FOLD} on {world_size} GPUs")
    mp.spawn(train_worker, args=(world_size,), nprocs=world_size, join=True)
