#!/usr/bin/env python
"""MLP over TF-IDF features with a full 13K-way sigmoid output layer (AmazonCat-13K).

Single-node job started with torch.multiprocessing (no torchrun on the tagging
boxes' cron runner):

    python 06_mlp_xmc_spawn.py --data-dir /data/xmc/amazoncat13k_tfidf --gpus 8
"""
import argparse
import os
import socket
import time
from contextlib import closing

import numpy as np
import scipy.sparse as sp
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def free_port():
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class CSRRows(Dataset):
    def __init__(self, X, Y, rows=None):
        self.X, self.Y = X, Y
        self.rows = np.arange(X.shape[0]) if rows is None else rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        x = self.X[r]
        y = self.Y[r]
        return x.indices.astype(np.int64), x.data.astype(np.float32), y.indices.astype(np.int64)


def collate(batch):
    offsets, idx, val, y_rows, y_cols = [], [], [], [], []
    off = 0
    for b, (xi, xv, yi) in enumerate(batch):
        offsets.append(off)
        off += len(xi)
        idx.append(torch.from_numpy(xi))
        val.append(torch.from_numpy(xv))
        y_rows.append(torch.full((len(yi),), b, dtype=torch.long))
        y_cols.append(torch.from_numpy(yi))
    return (torch.cat(idx), torch.cat(val), torch.tensor(offsets),
            torch.cat(y_rows), torch.cat(y_cols), len(batch))


class MLPXMC(nn.Module):
    def __init__(self, num_features, num_labels, hidden=2048, bottleneck=512):
        super().__init__()
        self.inp = nn.EmbeddingBag(num_features, hidden, mode="sum")
        self.body = nn.Sequential(
            nn.BatchNorm1d(hidden), nn.ReLU(), nn.Dropout(0.3),
            nn.Linear(hidden, bottleneck), nn.BatchNorm1d(bottleneck), nn.ReLU(),
        )
        self.out = nn.Linear(bottleneck, num_labels)

    def forward(self, idx, val, offsets):
        return self.out(self.body(self.inp(idx, offsets, per_sample_weights=val)))


def dense_targets(n, y_rows, y_cols, num_labels, device):
    t = torch.zeros(n, num_labels, device=device)
    t[y_rows.to(device), y_cols.to(device)] = 1.0
    return t


@torch.no_grad()
def evaluate(net, loader, num_labels, device, k=5):
    net.eval()
    s = torch.zeros(4, dtype=torch.float64, device=device)      # P@1, P@3, P@5, n
    for idx, val, offsets, y_rows, y_cols, n in loader:
        logits = net(idx.to(device), val.to(device), offsets.to(device))
        top = logits.topk(k, dim=1).indices
        t = dense_targets(n, y_rows, y_cols, num_labels, device)
        hit = t.gather(1, top).double()
        s[0] += hit[:, :1].sum()
        s[1] += hit[:, :3].sum() / 3
        s[2] += hit[:, :5].sum() / 5
        s[3] += n
    dist.all_reduce(s)
    net.train()
    return (s[:3] / s[3]).tolist()


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    X_tr = sp.load_npz(os.path.join(args.data_dir, "X_train.npz")).tocsr()
    Y_tr = sp.load_npz(os.path.join(args.data_dir, "Y_train.npz")).tocsr()
    X_te = sp.load_npz(os.path.join(args.data_dir, "X_test.npz")).tocsr()
    Y_te = sp.load_npz(os.path.join(args.data_dir, "Y_test.npz")).tocsr()
    num_features, num_labels = X_tr.shape[1], Y_tr.shape[1]

    train_ds = CSRRows(X_tr, Y_tr)
    test_ds = CSRRows(X_te, Y_te, rows=np.arange(rank, X_te.shape[0], world_size))
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.global_batch // world_size,
                              sampler=sampler, collate_fn=collate, num_workers=4,
                              pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_ds, batch_size=1024, collate_fn=collate, num_workers=2)

    net = MLPXMC(num_features, num_labels, args.hidden, args.bottleneck)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    start = 0
    ckpt_path = os.path.join(args.out_dir, "last.pt")
    if args.resume and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=f"cuda:{rank}")
        net.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        start = ckpt["epoch"] + 1
    model = DDP(net, device_ids=[rank])
    scaler = torch.cuda.amp.GradScaler()

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        tic = time.time()
        for i, (idx, val, offsets, y_rows, y_cols, n) in enumerate(train_loader):
            idx = idx.to(device, non_blocking=True)
            val = val.to(device, non_blocking=True)
            offsets = offsets.to(device, non_blocking=True)
            target = dense_targets(n, y_rows, y_cols, num_labels, device)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(idx, val, offsets)
            loss = F.binary_cross_entropy_with_logits(logits.float(), target, reduction="sum") / n
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            if rank == 0 and i % 100 == 0:
                print(f"[{epoch}:{i}] loss {loss.item():.3f} ({time.time() - tic:.0f}s)", flush=True)

        p1, p3, p5 = evaluate(net, test_loader, num_labels, device)
        if rank == 0:
            print(f"epoch {epoch}: P@1 {p1:.4f} P@3 {p3:.4f} P@5 {p5:.4f}", flush=True)
            os.makedirs(args.out_dir, exist_ok=True)
            tmp = ckpt_path + ".tmp"
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch}, tmp)
            os.replace(tmp, ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--out-dir", default="/data/xmc/runs/mlp_amazoncat")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--global-batch", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--bottleneck", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
