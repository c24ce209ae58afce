#!/usr/bin/env python
"""PTB-XL 12-lead ECG superdiagnostic classification, 10-fold CV (strat_fold column), DDP.

The first `aux_epochs` epochs add an auxiliary age/sex head (multi-task warm-up);
afterwards only the diagnostic head is trained.

    torchrun --nproc_per_node=4 06_ptbxl_ecg_cv.py --data data/ptbxl_500hz.npy --meta data/ptbxl_meta.csv
"""
import argparse
import contextlib
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

SUPER = ["NORM", "MI", "STTC", "CD", "HYP"]


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--meta", required=True)
    ap.add_argument("--out", default="runs/ptbxl_resnet1d")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--aux-epochs", type=int, default=10)
    ap.add_argument("--bs", type=int, default=64, help="per GPU, before accumulation")
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--patience", type=int, default=8)
    ap.add_argument("--workers", type=int, default=4)
    return ap.parse_args()


class ECGDataset(Dataset):
    def __init__(self, X, y, age, sex, rows, train):
        self.X, self.y, self.age, self.sex, self.rows, self.train = X, y, age, sex, rows, train

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        x = self.X[r].astype(np.float32)  # (12, 5000)
        if self.train:
            start = np.random.randint(0, x.shape[1] - 4000 + 1)
            x = x[:, start:start + 4000]
            x = x * np.random.uniform(0.9, 1.1) + np.random.normal(0, 0.01, x.shape).astype(np.float32)
        else:
            x = x[:, 500:4500]
        return torch.from_numpy(x), torch.from_numpy(self.y[r]), self.age[r], self.sex[r], r


class ResBlock1d(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv1d(cin, cout, 15, stride, 7, bias=False)
        self.bn1 = nn.BatchNorm1d(cout)
        self.conv2 = nn.Conv1d(cout, cout, 15, 1, 7, bias=False)
        self.bn2 = nn.BatchNorm1d(cout)
        self.skip = nn.Sequential(nn.Conv1d(cin, cout, 1, stride, bias=False), nn.BatchNorm1d(cout)) \
            if (stride != 1 or cin != cout) else nn.Identity()

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(h)) + self.skip(x))


class ECGNet(nn.Module):
    def __init__(self, n_out=len(SUPER)):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv1d(12, 64, 15, 2, 7, bias=False), nn.BatchNorm1d(64), nn.ReLU())
        chans = [64, 64, 128, 128, 256, 256, 320, 320]
        blocks, cin = [], 64
        for i, c in enumerate(chans):
            blocks.append(ResBlock1d(cin, c, 2 if i % 2 == 0 else 1))
            cin = c
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, n_out)
        self.aux = nn.Linear(cin, 2)  # age (regression), sex (logit)

    def forward(self, x, with_aux=False):
        h = self.blocks(self.stem(x))
        h = 0.5 * (h.mean(-1) + h.amax(-1))
        if with_aux:
            return self.head(h), self.aux(h)
        return self.head(h)


def macro_auc(y, p):
    return float(np.mean([roc_auc_score(y[:, c], p[:, c]) for c in range(y.shape[1])]))


@torch.no_grad()
def collect(model, loader, device, world_size):
    model.eval()
    rows, probs = [], []
    for x, _, _, _, r in loader:
        probs.append(torch.sigmoid(model(x.to(device))).cpu().numpy())
        rows.append(r.numpy())
    out = [None] * world_size
    dist.all_gather_object(out, (np.concatenate(rows), np.concatenate(probs)))
    rows = np.concatenate([o[0] for o in out])
    probs = np.concatenate([o[1] for o in out])
    rows, keep = np.unique(rows, return_index=True)
    return rows, probs[keep]


def make_eval_loader(ds, args):
    return DataLoader(ds, args.bs * 2, sampler=DistributedSampler(ds, shuffle=False),
                      num_workers=args.workers, pin_memory=True)


def run_fold(k, data, args, rank, local_rank, world_size, writer):
    device = torch.device("cuda", local_rank)
    X, Y, age, sex, folds = data
    # folds 1-8 train, fold 9 validation for early stopping is the PTB-XL convention;
    # here every strat_fold is held out once and the next one is used for early stopping
    val_fold = k % 10 + 1
    tr_rows = np.where((folds != k) & (folds != val_fold))[0]
    es_rows = np.where(folds == val_fold)[0]
    te_rows = np.where(folds == k)[0]

    tr_ds = ECGDataset(X, Y, age, sex, tr_rows, train=True)
    tr_sampler = DistributedSampler(tr_ds, shuffle=True, seed=k)
    tr_dl = DataLoader(tr_ds, args.bs, sampler=tr_sampler, num_workers=args.workers, drop_last=True, pin_memory=True)
    es_dl = make_eval_loader(ECGDataset(X, Y, age, sex, es_rows, train=False), args)
    te_dl = make_eval_loader(ECGDataset(X, Y, age, sex, te_rows, train=False), args)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(ECGNet()).to(device)
    # the aux head is only used during the first aux_epochs
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs,
                                                steps_per_epoch=len(tr_dl) // args.accum)

    best, wait = -1.0, 0
    ckpt = os.path.join(args.out, f"ecg_fold{k}.pt")
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        use_aux = epoch < args.aux_epochs
        t0 = time.time()
        for i, (x, y, a, s, _) in enumerate(tr_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            last_micro = (i + 1) % args.accum == 0
            ctx = contextlib.nullcontext() if last_micro else model.no_sync()
            with ctx:
                if use_aux:
                    logits, aux = model(x, with_aux=True)
                    a = ((a.float() - 60.0) / 20.0).to(device)
                    s = s.float().to(device)
                    loss = F.binary_cross_entropy_with_logits(logits, y) \
                        + 0.2 * (F.mse_loss(aux[:, 0], a) + F.binary_cross_entropy_with_logits(aux[:, 1], s))
                else:
                    loss = F.binary_cross_entropy_with_logits(model(x), y)
                (loss / args.accum).backward()
            if last_micro:
                opt.step()
                opt.zero_grad(set_to_none=True)
                if sched.last_epoch + 1 < sched.total_steps:
                    sched.step()

        rows, probs = collect(model, es_dl, device, world_size)
        auc = macro_auc(Y[rows], probs)
        improved = auc > best
        if rank == 0:
            writer.add_scalar(f"fold{k}/val_auc", auc, epoch)
            print(f"fold {k} epoch {epoch} es-AUC {auc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if improved:
                torch.save(model.module.state_dict(), ckpt)
        if improved:
            best, wait = auc, 0
        else:
            wait += 1
        # all ranks compute the same AUC, but make the stop decision collective anyway
        stop = torch.tensor(int(wait >= args.patience), device=device)
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item():
            break

    dist.barrier()
    model.module.load_state_dict(torch.load(ckpt, map_location=device))
    rows, probs = collect(model, te_dl, device, world_size)
    return rows, probs


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    os.makedirs(args.out, exist_ok=True)
    writer = SummaryWriter(args.out) if rank == 0 else None

    X = np.load(args.data, mmap_mode="r")  # (N, 12, 5000) float16
    meta = pd.read_csv(args.meta)
    Y = meta[SUPER].to_numpy(np.float32)
    age = meta["age"].fillna(60).to_numpy(np.float32)
    sex = meta["sex"].to_numpy(np.float32)
    folds = meta["strat_fold"].to_numpy()
    data = (X, Y, age, sex, folds)

    oof = np.zeros_like(Y)
    for k in range(1, 11):
        rows, probs = run_fold(k, data, args, rank, local_rank, world_size, writer)
        oof[rows] = probs
        if rank == 0:
            print(f"fold {k} test macro-AUC {macro_auc(Y[rows], probs):.4f}", flush=True)

    if rank == 0:
        print(f"10-fold OOF macro-AUC {macro_auc(Y, oof):.4f}")
        np.save(os.path.join(args.out, "oof.npy"), oof)
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
