#!/usr/bin/env python3
"""
Radar precipitation nowcasting: 6 past frames (5-min) -> 6 future frames with a small ConvGRU
encoder-forecaster. Radar composites are stored as yearly HDF5 files, "rr" (T, 256, 256) in mm/h.

Single node, one process per GPU via torch.multiprocessing:

    python 10_radar_nowcast_spawn.py --data_dir /data/radolan_256 --epochs 50
"""
import argparse
import os
import socket
import time

import h5py
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

N_IN, N_OUT = 6, 6
THRESHOLDS = [0.5, 2.0, 5.0, 10.0]  # mm/h for CSI


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class RadarSeq(Dataset):
    def __init__(self, files, min_wet_frac=0.05):
        self.files = files
        self.samples = []
        for fi, path in enumerate(files):
            with h5py.File(path, "r") as f:
                wet = f["wet_frac"][:]  # precomputed fraction of pixels > 0.1 mm/h per frame
            T = len(wet)
            for t in range(0, T - N_IN - N_OUT, 3):
                if wet[t + N_IN - 1] >= min_wet_frac:
                    self.samples.append((fi, t))
        self._h = {}

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        fi, t = self.samples[i]
        if fi not in self._h:
            self._h[fi] = h5py.File(self.files[fi], "r")
        seq = self._h[fi]["rr"][t:t + N_IN + N_OUT].astype(np.float32)
        seq = np.log1p(np.clip(seq, 0, 128))  # compress dynamic range
        seq = torch.from_numpy(seq)[:, None]
        return seq[:N_IN], seq[N_IN:]


class ConvGRUCell(nn.Module):
    def __init__(self, cin, ch, k=3):
        super().__init__()
        self.ch = ch
        self.gates = nn.Conv2d(cin + ch, 2 * ch, k, padding=k // 2)
        self.cand = nn.Conv2d(cin + ch, ch, k, padding=k // 2)

    def forward(self, x, h):
        if h is None:
            h = torch.zeros(x.shape[0], self.ch, x.shape[2], x.shape[3], device=x.device, dtype=x.dtype)
        z, r = torch.sigmoid(self.gates(torch.cat([x, h], 1))).chunk(2, 1)
        n = torch.tanh(self.cand(torch.cat([x, r * h], 1)))
        return (1 - z) * h + z * n


class NowcastNet(nn.Module):
    def __init__(self, ch=64):
        super().__init__()
        self.down = nn.Sequential(nn.Conv2d(1, 32, 4, 2, 1), nn.LeakyReLU(0.2), nn.Conv2d(32, ch, 4, 2, 1), nn.LeakyReLU(0.2))
        self.enc = ConvGRUCell(ch, ch)
        self.dec = ConvGRUCell(ch, ch)
        self.up = nn.Sequential(nn.ConvTranspose2d(ch, 32, 4, 2, 1), nn.LeakyReLU(0.2), nn.ConvTranspose2d(32, 1, 4, 2, 1))

    def forward(self, x):  # x: (B, T, 1, H, W)
        h = None
        for t in range(x.shape[1]):
            h = self.enc(self.down(x[:, t]), h)
        outs = []
        inp = torch.zeros_like(h)
        for _ in range(N_OUT):
            h = self.dec(inp, h)
            inp = h
            outs.append(self.up(h))
        return torch.stack(outs, 1)


def csi_counts(pred, target):
    """hits, misses, false alarms per threshold in mm/h."""
    p, t = torch.expm1(pred), torch.expm1(target)
    out = []
    for th in THRESHOLDS:
        pb, tb = p >= th, t >= th
        out += [(pb & tb).sum(), (~pb & tb).sum(), (pb & ~tb).sum()]
    return torch.stack(out).double()


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(1000 + rank)

    files = sorted(os.path.join(args.data_dir, f) for f in os.listdir(args.data_dir) if f.endswith(".h5"))
    train_files = [f for f in files if not os.path.basename(f).startswith(args.val_year)]
    val_files = [f for f in files if os.path.basename(f).startswith(args.val_year)]
    train_ds, val_ds = RadarSeq(train_files), RadarSeq(val_files)
    if rank == 0:
        print(f"{len(train_ds)} train / {len(val_ds)} val sequences on {world_size} GPUs", flush=True)

    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4, pin_memory=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world_size)), batch_size=args.batch_size,
                        num_workers=4)

    model = DDP(NowcastNet().to(device), device_ids=[rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.5)

    rows = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        s = torch.zeros(2, device=device)
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            pred = model(x)
            # weight heavy rain more, like the balanced MSE/MAE of Shi et al. 2017
            w = 1.0 + 4.0 * (y > np.log1p(2.0)).float() + 10.0 * (y > np.log1p(10.0)).float()
            loss = (w * ((pred - y) ** 2 + (pred - y).abs())).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 3.0)
            opt.step()
            s += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(s)

        model.module.eval()
        counts = torch.zeros(3 * len(THRESHOLDS), dtype=torch.float64, device=device)
        with torch.no_grad():
            for x, y in val_dl:
                counts += csi_counts(model.module(x.to(device)), y.to(device))
        dist.all_reduce(counts)
        c = counts.view(-1, 3)
        csi = (c[:, 0] / (c.sum(1)).clamp(min=1)).cpu().numpy()

        if rank == 0:
            row = {"epoch": epoch, "loss": (s[0] / s[1]).item(), "time": time.time() - t0}
            row.update({f"csi_{th}": float(v) for th, v in zip(THRESHOLDS, csi)})
            rows.append(row)
            pd.DataFrame(rows).to_csv(os.path.join(args.out, "metrics.csv"), index=False)
            print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(args.out, "nowcast.pt"))
        dist.barrier()

    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--val_year", default="2019")
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--out", default="runs/nowcast")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    args.port = free_port()
    world_size = torch.cuda.device_count()
    mp.spawn(worker, args=(world_size, args), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
