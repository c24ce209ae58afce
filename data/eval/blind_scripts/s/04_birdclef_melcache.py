#!/usr/bin/env python
# BirdCLEF - log-mel cached once, timm CNN on 5s crops, k-fold.
#   torchrun --nproc_per_node=4 04_birdclef_melcache.py --fold 1
import os
import gc
import time
import pickle
import argparse
from pathlib import Path

import numpy as np
import pandas as pd
import librosa
from joblib import Parallel, delayed
import torch
import torch.nn as nn
import torch.distributed as dist
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
from sklearn.metrics import average_precision_score
import timm

SR = 32000
N_MELS = 128
HOP = 320
FMIN, FMAX = 50, 14000
CROP_SEC = 5


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/kaggle/input/birdclef-2024")
    p.add_argument("--cache_dir", default="/kaggle/working/cache")
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--arch", default="eca_nfnet_l0")
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--bs", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max_sec", type=int, default=15)
    p.add_argument("--n_jobs", type=int, default=16)
    p.add_argument("--out", default="runs/nfnet")
    return p.parse_args()


def file_to_mel(path, max_sec):
    y, _ = librosa.load(path, sr=SR, mono=True, duration=max_sec)
    m = librosa.feature.melspectrogram(y=y, sr=SR, n_mels=N_MELS, hop_length=HOP,
                                       fmin=FMIN, fmax=FMAX, n_fft=2048)
    m = librosa.power_to_db(m, ref=np.max).astype(np.float16)
    return m


def build_mel_cache(df, root, cache_file, max_sec, n_jobs):
    paths = [os.path.join(root, "train_audio", f) for f in df.filename.values]
    mels = Parallel(n_jobs=n_jobs)(delayed(file_to_mel)(p, max_sec) for p in paths)
    cache = dict(zip(df.filename.values, mels))
    with open(cache_file, "wb") as f:
        pickle.dump(cache, f, protocol=4)


def load_mel_cache(df, args):
    os.makedirs(args.cache_dir, exist_ok=True)
    cache_file = os.path.join(args.cache_dir, f"mels_{SR}_{N_MELS}_{HOP}_{args.max_sec}s.pkl")
    if not os.path.exists(cache_file):
        build_mel_cache(df, args.root, cache_file, args.max_sec, args.n_jobs)
    with open(cache_file, "rb") as f:
        return pickle.load(f)


class MelDataset(Dataset):
    def __init__(self, df, mels, labels, train):
        self.fn = df.filename.values
        self.mels = mels
        self.labels = labels
        self.train = train
        self.frames = CROP_SEC * SR // HOP

    def __len__(self):
        return len(self.fn)

    def __getitem__(self, i):
        m = self.mels[self.fn[i]].astype(np.float32)
        T = m.shape[1]
        if T < self.frames:
            m = np.pad(m, ((0, 0), (0, self.frames - T)), constant_values=m.min())
            T = self.frames
        start = np.random.randint(0, T - self.frames + 1) if self.train else 0
        m = m[:, start:start + self.frames]
        m = (m + 80.0) / 80.0
        if self.train and np.random.rand() < 0.5:
            f0 = np.random.randint(0, N_MELS - 16)
            m[f0:f0 + np.random.randint(4, 16)] = 0
        return torch.from_numpy(m)[None].repeat(3, 1, 1), torch.from_numpy(self.labels[i]), i


def padded_cmap(y, p, pad=5):
    y = np.concatenate([y, np.ones((pad, y.shape[1]))])
    p = np.concatenate([p, np.ones((pad, p.shape[1]))])
    return average_precision_score(y, p, average="macro")


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, ws = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    df = pd.read_csv(os.path.join(args.root, "train_metadata_folds.csv"))
    classes = sorted(df.primary_label.unique())
    c2i = {c: i for i, c in enumerate(classes)}
    Y = np.zeros((len(df), len(classes)), dtype=np.float32)
    Y[np.arange(len(df)), df.primary_label.map(c2i).values] = 1.0

    mels = load_mel_cache(df, args)

    tr_idx = np.where(df.fold != args.fold)[0]
    va_idx = np.where(df.fold == args.fold)[0]
    tr_ds = MelDataset(df.iloc[tr_idx], mels, Y[tr_idx], True)
    va_ds = MelDataset(df.iloc[va_idx], mels, Y[va_idx], False)
    tr_s = DistributedSampler(tr_ds, shuffle=True)
    va_s = DistributedSampler(va_ds, shuffle=False)
    tr_dl = DataLoader(tr_ds, batch_size=args.bs, sampler=tr_s, num_workers=4, drop_last=True)
    va_dl = DataLoader(va_ds, batch_size=args.bs, sampler=va_s, num_workers=4)

    net = timm.create_model(args.arch, pretrained=True, num_classes=len(classes))
    net = DDP(net.to(dev), device_ids=[local_rank])
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=1e-2)
    sch = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs, eta_min=1e-6)
    scaler = torch.cuda.amp.GradScaler()
    bce = nn.BCEWithLogitsLoss()

    if rank == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        logf = open(f"{args.out}/fold{args.fold}.csv", "w")
        logf.write("epoch,loss,cmap\n")
    best = 0.0
    for ep in range(args.epochs):
        tr_s.set_epoch(ep)
        net.train()
        tot = torch.zeros(2, device=dev)
        t0 = time.time()
        for x, y, _ in tr_dl:
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            # mixup inside the batch
            lam = np.random.beta(0.4, 0.4)
            perm = torch.randperm(x.size(0), device=dev)
            x = lam * x + (1 - lam) * x[perm]
            y = torch.maximum(y, y[perm]) if lam > 0.2 else y
            with torch.cuda.amp.autocast():
                loss = bce(net(x), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            tot += torch.stack([loss.detach() * x.size(0), torch.tensor(float(x.size(0)), device=dev)])
        sch.step()
        dist.all_reduce(tot)

        net.eval()
        P, I = [], []
        with torch.no_grad():
            for x, y, i in va_dl:
                with torch.cuda.amp.autocast():
                    P.append(net(x.to(dev)).sigmoid().float().cpu().numpy())
                I.append(i.numpy())
        res = [None] * ws
        dist.all_gather_object(res, (np.concatenate(P), np.concatenate(I)))
        if rank == 0:
            P = np.concatenate([r[0] for r in res])
            I = np.concatenate([r[1] for r in res])
            I, keep = np.unique(I, return_index=True)
            cmap = padded_cmap(Y[va_idx][I], P[keep])
            tl = (tot[0] / tot[1]).item()
            print(f"fold{args.fold} ep{ep:02d} loss {tl:.4f} cmAP {cmap:.4f} {time.time() - t0:.0f}s")
            logf.write(f"{ep},{tl:.5f},{cmap:.5f}\n")
            logf.flush()
            if cmap > best:
                best = cmap
                torch.save(net.module.state_dict(), f"{args.out}/{args.arch}_f{args.fold}.pt")
        dist.barrier()

    if rank == 0:
        logf.close()
    del mels
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
