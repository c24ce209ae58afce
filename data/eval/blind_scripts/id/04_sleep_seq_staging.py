"""Sequence-to-sequence sleep staging on Sleep-EDF-78 (Fpz-Cz + Pz-Oz, 100 Hz).

Each recording is stored as an .npz with x: (n_epochs, 2, 3000) and
y: (n_epochs,) in {W, N1, N2, N3, REM} = {0..4}.  Training samples are sliding
windows of `seq_len` consecutive 30-s epochs with stride `seq_stride`; the
model (epoch encoder CNN + bidirectional GRU over the sequence) predicts a
stage for every epoch in the window.

Subject-wise split is read from folds/fold_{k}.json (train/valid subject ids).
"""
import argparse
import glob
import json
import os
import re
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import cohen_kappa_score, f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

STAGES = ["W", "N1", "N2", "N3", "REM"]


class SlidingSeqDataset(Dataset):
    def __init__(self, files, seq_len, stride):
        self.recs = []
        self.index = []
        for r, f in enumerate(files):
            d = np.load(f)
            x = d["x"].astype(np.float32)
            # per-recording, per-channel standardisation
            x = (x - x.mean(axis=(0, 2), keepdims=True)) / (x.std(axis=(0, 2), keepdims=True) + 1e-6)
            self.recs.append((x, d["y"].astype(np.int64)))
            for s in range(0, len(x) - seq_len + 1, stride):
                self.index.append((r, s))
        self.seq_len = seq_len

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        r, s = self.index[i]
        x, y = self.recs[r]
        return torch.from_numpy(x[s:s + self.seq_len]), torch.from_numpy(y[s:s + self.seq_len])


class EpochEncoder(nn.Module):
    def __init__(self, in_ch=2, dim=128):
        super().__init__()
        def blk(i, o, k, s, pool):
            return nn.Sequential(nn.Conv1d(i, o, k, s, padding=k // 2, bias=False),
                                 nn.BatchNorm1d(o), nn.ReLU(inplace=True), nn.MaxPool1d(pool))
        self.net = nn.Sequential(
            blk(in_ch, 64, 50, 6, 8), nn.Dropout(0.5),
            blk(64, 128, 8, 1, 1), blk(128, 128, 8, 1, 1), blk(128, dim, 8, 1, 4),
            nn.AdaptiveAvgPool1d(1), nn.Flatten(),
        )

    def forward(self, x):
        return self.net(x)


class SeqSleepNet(nn.Module):
    def __init__(self, dim=128, hidden=128, n_classes=5):
        super().__init__()
        self.encoder = EpochEncoder(dim=dim)
        self.gru = nn.GRU(dim, hidden, num_layers=2, batch_first=True, bidirectional=True, dropout=0.2)
        self.fc = nn.Linear(2 * hidden, n_classes)

    def forward(self, x):  # x: (B, L, C, T)
        B, L = x.shape[:2]
        z = self.encoder(x.flatten(0, 1)).view(B, L, -1)
        h, _ = self.gru(z)
        return self.fc(h)


def subject_of(path):
    # SC4ssNE0-PSG.npz -> subject ss
    return int(re.search(r"SC4(\d\d)", os.path.basename(path)).group(1))


def class_weights(ds, n_classes=5):
    counts = np.zeros(n_classes)
    for _, y in ds.recs:
        counts += np.bincount(y, minlength=n_classes)
    w = counts.sum() / (n_classes * np.maximum(counts, 1))
    return torch.tensor(w, dtype=torch.float32)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    ys, ps = [], []
    for x, y in loader:
        logits = model(x.to(device, non_blocking=True))
        # only score the centre epoch of each window so every epoch counts once
        c = x.shape[1] // 2
        ps.append(logits[:, c].argmax(-1).cpu())
        ys.append(y[:, c])
    y = torch.cat(ys).numpy()
    p = torch.cat(ps).numpy()
    return (y == p).mean(), f1_score(y, p, average="macro"), cohen_kappa_score(y, p)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/sleep-edf-78/npz")
    ap.add_argument("--fold", type=int, default=0)
    ap.add_argument("--seq_len", type=int, default=20)
    ap.add_argument("--seq_stride", type=int, default=5)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--out", default="out/seqsleep")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    with open(os.path.join(args.data, "..", "folds", f"fold_{args.fold}.json")) as f:
        fold = json.load(f)
    files = sorted(glob.glob(os.path.join(args.data, "*.npz")))
    train_files = [f for f in files if subject_of(f) in set(fold["train"])]
    valid_files = [f for f in files if subject_of(f) in set(fold["valid"])]

    train_ds = SlidingSeqDataset(train_files, args.seq_len, args.seq_stride)
    valid_ds = SlidingSeqDataset(valid_files, args.seq_len, 1)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True,
                          num_workers=args.workers, pin_memory=True, drop_last=True)
    valid_dl = DataLoader(valid_ds, batch_size=128, shuffle=False, num_workers=args.workers)

    model = SeqSleepNet().to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    cw = class_weights(train_ds).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999), weight_decay=1e-3)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=5)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"fold {args.fold}: {len(train_files)} train recs ({len(train_ds)} windows), "
              f"{len(valid_files)} valid recs, world={world}")

    best_f1 = 0.0
    for epoch in range(args.epochs):
        model.train()
        t0, tot, n = time.time(), 0.0, 0
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, 5), y.reshape(-1), weight=cw)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            tot += loss.item()
            n += 1

        # validation on the main process only; the other ranks wait in the broadcast
        f1_t = torch.zeros(1, device=device)
        if rank == 0:
            acc, mf1, kappa = evaluate(model.module, valid_dl, device)
            f1_t.fill_(mf1)
            print(f"epoch {epoch:02d} loss {tot / n:.4f} acc {acc:.4f} MF1 {mf1:.4f} "
                  f"kappa {kappa:.4f} {time.time() - t0:.0f}s", flush=True)
            if mf1 > best_f1:
                best_f1 = mf1
                torch.save(model.module.state_dict(), os.path.join(args.out, f"fold{args.fold}_best.pt"))
        dist.broadcast(f1_t, src=0)
        sched.step(f1_t.item())

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
