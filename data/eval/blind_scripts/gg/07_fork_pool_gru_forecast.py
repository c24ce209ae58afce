#!/usr/bin/env python3
"""Multivariate load forecasting (GRU encoder + MLP head), multi-GPU on one host.

    python 07_fork_pool_gru_forecast.py --parquet data/load_15min.parquet --gpus 0,1,2,3

The series (a few GB of float32) is read once in the parent and the workers are
forked from it, so they share the arrays copy-on-write instead of each loading
the parquet file. The parent never touches CUDA; each child picks its own GPU
through CUDA_VISIBLE_DEVICES before CUDA starts in it. Child k writes to
<out>/logs/worker_k.log. A failed group is torn down and started again, and the
workers continue from <out>/state.pt.
"""
import argparse
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--parquet", default="data/load_15min.parquet")
    p.add_argument("--gpus", default=None, help="comma list; default: all GPUs nvidia-smi reports")
    p.add_argument("--out", default="runs/gru_forecast")
    p.add_argument("--context", type=int, default=672)   # one week of 15 min steps
    p.add_argument("--horizon", type=int, default=96)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=1024)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--val-frac", type=float, default=0.1)
    p.add_argument("--retries", type=int, default=3)
    return p.parse_args()


class Windows(Dataset):
    def __init__(self, series, start, stop, context, horizon):
        self.series = series
        self.context, self.horizon = context, horizon
        self.starts = np.arange(start, stop - context - horizon + 1, dtype=np.int64)

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        s = self.starts[i]
        x = self.series[s:s + self.context]
        y = self.series[s + self.context:s + self.context + self.horizon]
        return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(y))


class Forecaster(nn.Module):
    def __init__(self, n_series, hidden, layers, horizon):
        super().__init__()
        self.inp = nn.Linear(n_series, hidden)
        self.gru = nn.GRU(hidden, hidden, num_layers=layers, batch_first=True, dropout=0.1)
        self.head = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, 2 * hidden), nn.GELU(),
                                  nn.Linear(2 * hidden, horizon * n_series))
        self.horizon, self.n_series = horizon, n_series

    def forward(self, x):
        h, _ = self.gru(self.inp(x))
        return self.head(h[:, -1]).view(-1, self.horizon, self.n_series)


def worker(rank, world_size, gpu, port, series, args):
    # runs in a freshly forked child: CUDA has not been initialised anywhere yet
    log = open(os.path.join(args.out, "logs", f"worker_{rank}.log"), "a", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    os.environ.update(CUDA_VISIBLE_DEVICES=gpu, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0")
    torch.cuda.set_device(0)  # the only device this process can see
    device = torch.device("cuda:0")
    dist.init_process_group("nccl")
    torch.manual_seed(0)

    n_val = int(len(series) * args.val_frac)
    split = len(series) - n_val
    train_ds = Windows(series, 0, split, args.context, args.horizon)
    val_ds = Windows(series, split - args.context, len(series), args.context, args.horizon)
    per_rank = args.global_batch // world_size
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=per_rank, sampler=sampler, num_workers=2,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world_size)),
                            batch_size=512, num_workers=2)

    model = Forecaster(series.shape[1], args.hidden, args.layers, args.horizon).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(train_loader))
    state_path = os.path.join(args.out, "state.pt")
    first_epoch, best = 0, float("inf")
    if os.path.exists(state_path):
        st = torch.load(state_path, map_location=device)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        first_epoch, best = st["epoch"] + 1, st["best"]
    ddp = DDP(model, device_ids=[0])

    for epoch in range(first_epoch, args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = nn.functional.l1_loss(ddp(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            sched.step()
            if i % 200 == 0:
                print(f"epoch {epoch} step {i}/{len(train_loader)} mae {loss.item():.4f}")

        model.eval()
        tot = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device), y.to(device)
                tot[0] += (model(x) - y).abs().sum().double()
                tot[1] += y.numel()
        dist.all_reduce(tot)
        val_mae = (tot[0] / tot[1]).item()
        print(f"epoch {epoch} val_mae {val_mae:.5f}")
        if rank == 0:
            if val_mae < best:
                best = val_mae
                torch.save(model.state_dict(), os.path.join(args.out, "best_model.pt"))
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "best": best}, state_path + ".tmp")
            os.replace(state_path + ".tmp", state_path)
        dist.barrier()
    dist.destroy_process_group()


def list_gpus():
    out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                         capture_output=True, text=True, check=True).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_series(path):
    df = pd.read_parquet(path).sort_index()
    arr = df.to_numpy(dtype=np.float32)
    mean, std = arr.mean(0, keepdims=True), arr.std(0, keepdims=True) + 1e-6
    return (arr - mean) / std


def main():
    args = parse_args()
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    gpus = args.gpus.split(",") if args.gpus else list_gpus()
    series = load_series(args.parquet)
    print(f"series {series.shape}, {len(gpus)} GPUs: {gpus}", flush=True)

    ctx = mp.get_context("fork")
    for attempt in range(args.retries + 1):
        port = free_port()
        procs = [ctx.Process(target=worker, args=(r, len(gpus), g, port, series, args), daemon=False)
                 for r, g in enumerate(gpus)]
        for p in procs:
            p.start()
        failed = False
        while any(p.is_alive() for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                failed = True
                break
            time.sleep(2)
        failed = failed or any(p.exitcode != 0 for p in procs)
        if not failed:
            print("done", flush=True)
            return 0
        print(f"attempt {attempt}: exit codes {[p.exitcode for p in procs]}, tearing down", flush=True)
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
        time.sleep(10)
    return 1


if __name__ == "__main__":
    sys.exit(main())
