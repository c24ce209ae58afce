"""Boiler sensor forecaster (conv-patch encoder) trained with mp.spawn on one node,
then per-sensor residual thresholds for alerting are fitted on the validation span.

    python 07_spawn_tcn_boiler.py --gpus 4 --data /srv/shared/boiler/b7.parquet
"""
import argparse
import os
import socket
from contextlib import nullcontext

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


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class Windows(Dataset):
    def __init__(self, arr, lookback, horizon):
        self.arr, self.lb, self.h = arr, lookback, horizon

    def __len__(self):
        return len(self.arr) - self.lb - self.h + 1

    def __getitem__(self, i):
        return (torch.from_numpy(self.arr[i:i + self.lb]),
                torch.from_numpy(self.arr[i + self.lb:i + self.lb + self.h]))


class ConvPatchEncoder(nn.Module):
    def __init__(self, n_ch, lookback, horizon, width=128, patch=16, layers=4):
        super().__init__()
        self.n_ch, self.horizon = n_ch, horizon
        self.stem = nn.Conv1d(n_ch, width, kernel_size=patch, stride=patch // 2)
        blocks = []
        for i in range(layers):
            blocks += [nn.Conv1d(width, width, 3, padding=2 ** i, dilation=2 ** i),
                       nn.BatchNorm1d(width), nn.GELU()]
        self.blocks = nn.Sequential(*blocks)
        n_tok = (lookback - patch) // (patch // 2) + 1
        self.head = nn.Linear(width * n_tok, horizon * n_ch)

    def forward(self, x):  # (B, L, C)
        last = x[:, -1:, :]
        h = self.stem((x - last).transpose(1, 2))
        h = h + self.blocks(h)
        y = self.head(h.flatten(1)).view(-1, self.horizon, self.n_ch)
        return y + last


def worker(rank, world_size, args, arrays):
    train_arr, val_arr = arrays
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    train_ds = Windows(train_arr, args.lookback, args.horizon)
    val_ds = Windows(val_arr, args.lookback, args.horizon)
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True,
                                 drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch, sampler=sampler, num_workers=3,
                          pin_memory=True, drop_last=True)
    # every rank scores a strided slice of the validation windows; no padding or duplicates
    val_part = Subset(val_ds, range(rank, len(val_ds), world_size))
    val_dl = DataLoader(val_part, batch_size=4 * args.batch, num_workers=3, pin_memory=True)

    net = ConvPatchEncoder(train_arr.shape[1], args.lookback, args.horizon)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-3)
    n_updates = len(train_dl) // args.accum
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * n_updates)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros(2, device=device)
        for i, (x, y) in enumerate(train_dl):
            if i >= n_updates * args.accum:
                break
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            last_micro = (i + 1) % args.accum == 0
            with (nullcontext() if last_micro else model.no_sync()):
                loss = F.huber_loss(model(x), y, delta=1.0)
                (loss / args.accum).backward()
            if last_micro:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            loss_sum[0] += loss.detach()
            loss_sum[1] += 1
        dist.all_reduce(loss_sum)
        if rank == 0:
            print(f"epoch {epoch} huber {loss_sum[0].item() / loss_sum[1].item():.4f}", flush=True)

    # residual statistics per sensor on validation -> k-sigma thresholds
    net.eval()
    C = train_arr.shape[1]
    stats = torch.zeros(3, C, device=device, dtype=torch.float64)
    with torch.no_grad():
        for x, y in val_dl:
            x, y = x.to(device), y.to(device)
            r = (net(x) - y).double().reshape(-1, C)
            stats[0] += r.sum(0)
            stats[1] += (r * r).sum(0)
            stats[2] += r.shape[0]
    dist.all_reduce(stats)
    mean = stats[0] / stats[2]
    std = (stats[1] / stats[2] - mean ** 2).clamp_min(0).sqrt()
    if rank == 0:
        thr_hi = (mean + args.k_sigma * std).cpu()
        thr_lo = (mean - args.k_sigma * std).cpu()
        os.makedirs(args.out, exist_ok=True)
        torch.save({"model": net.state_dict(), "thr_hi": thr_hi, "thr_lo": thr_lo,
                    "sensor_names": args.sensor_names}, os.path.join(args.out, "boiler_model.pt"))
        print("per-sensor residual std:", np.round(std.cpu().numpy(), 4).tolist())
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="artifacts/boiler_b7")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--lookback", type=int, default=288)
    ap.add_argument("--horizon", type=int, default=24)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--k-sigma", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()

    df = pd.read_parquet(args.data).sort_index()
    df = df.ffill(limit=5).dropna()
    args.sensor_names = list(df.columns)
    arr = df.to_numpy(np.float32)
    split = int(0.8 * len(arr))
    mu, sd = arr[:split].mean(0), arr[:split].std(0) + 1e-6
    arr = ((arr - mu) / sd).astype(np.float32)
    train_arr, val_arr = arr[:split], arr[split - args.lookback:]

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(worker, args=(args.gpus, args, (train_arr, val_arr)), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
