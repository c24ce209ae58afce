#!/usr/bin/env python3
"""Multi-horizon load forecasting (seq2seq LSTM), single-node multi-GPU.

Used inside an interactive allocation or a one-node batch job, e.g.

    salloc -N1 --gpus-per-node=4 --exclusive
    srun --ntasks=1 python forecast_ddp.py --data /project/load/npz --out /project/load/runs/lstm

    qsub -I -l select=1:ngpus=4
    python forecast_ddp.py --data ... --out ...

The launcher picks an unused TCP port on this node (several of us share the
GPU nodes), then starts one training process per visible GPU and waits for them.
"""
import argparse
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class Windows(Dataset):
    """Sliding windows over a (T, n_series, n_feat) array stored as npz."""

    def __init__(self, path, lookback, horizon, stats=None):
        arr = np.load(path)["x"].astype(np.float32)
        if stats is None:
            stats = (arr.mean(axis=0, keepdims=True), arr.std(axis=0, keepdims=True) + 1e-6)
        self.mean, self.std = stats
        self.x = (arr - self.mean) / self.std
        self.lookback, self.horizon = lookback, horizon
        self.n_t = self.x.shape[0] - lookback - horizon + 1
        self.n_series = self.x.shape[1]

    def __len__(self):
        return self.n_t * self.n_series

    def __getitem__(self, i):
        t, s = divmod(i, self.n_series)
        past = self.x[t:t + self.lookback, s]
        fut = self.x[t + self.lookback:t + self.lookback + self.horizon, s, 0]
        return torch.from_numpy(past), torch.from_numpy(fut)


class Seq2Seq(nn.Module):
    def __init__(self, n_feat, hidden, layers, horizon, dropout=0.1):
        super().__init__()
        self.enc = nn.LSTM(n_feat, hidden, layers, batch_first=True, dropout=dropout)
        self.dec = nn.LSTM(1, hidden, layers, batch_first=True, dropout=dropout)
        self.proj = nn.Linear(hidden, 1)
        self.horizon = horizon

    def forward(self, past):
        _, state = self.enc(past)
        y = past[:, -1:, :1]
        outs = []
        for _ in range(self.horizon):
            h, state = self.dec(y, state)
            y = self.proj(h)
            outs.append(y)
        return torch.cat(outs, dim=1).squeeze(-1)


def run_worker(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    train_ds = Windows(os.path.join(args.data, "train.npz"), args.lookback, args.horizon)
    val_ds = Windows(os.path.join(args.data, "val.npz"), args.lookback, args.horizon,
                     stats=(train_ds.mean, train_ds.std))
    tr_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    va_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    per_gpu = args.global_batch // world
    tr_dl = DataLoader(train_ds, per_gpu, sampler=tr_sampler, num_workers=4, pin_memory=True, drop_last=True)
    va_dl = DataLoader(val_ds, 1024, sampler=va_sampler, num_workers=4, pin_memory=True)

    model = Seq2Seq(train_ds.x.shape[-1], args.hidden, args.layers, args.horizon).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=3)
    loss_fn = nn.SmoothL1Loss()

    best = float("inf")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for past, fut in tr_dl:
            past, fut = past.to(device, non_blocking=True), fut.to(device, non_blocking=True)
            loss = loss_fn(model(past), fut)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()

        model.eval()
        err = torch.zeros(3, device=device, dtype=torch.float64)
        with torch.no_grad():
            for past, fut in va_dl:
                past, fut = past.to(device, non_blocking=True), fut.to(device, non_blocking=True)
                pred = model(past)
                err[0] += (pred - fut).abs().sum().double()
                err[1] += ((pred - fut) ** 2).sum().double()
                err[2] += fut.numel()
        dist.all_reduce(err)
        mae = (err[0] / err[2]).item()
        rmse = (err[1] / err[2]).sqrt().item()
        sched.step(mae)
        if rank == 0:
            print(f"epoch {epoch:3d} train_loss {loss.item():.4f} val_mae {mae:.4f} val_rmse {rmse:.4f} "
                  f"lr {opt.param_groups[0]['lr']:.1e} {time.time() - t0:.0f}s", flush=True)
            if mae < best:
                best = mae
                torch.save({"model": model.module.state_dict(), "mean": train_ds.mean, "std": train_ds.std,
                            "args": vars(args), "epoch": epoch}, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


def launch(args):
    ngpus = torch.cuda.device_count()
    if args.port == 0:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind(("", 0))
        args.port = s.getsockname()[1]
    print(f"starting {ngpus} workers, rendezvous 127.0.0.1:{args.port}", flush=True)

    procs = []
    for lr_ in range(ngpus):
        env = os.environ.copy()
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), WORLD_SIZE=str(ngpus),
                   RANK=str(lr_), LOCAL_RANK=str(lr_), OMP_NUM_THREADS="4")
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", *sys.argv[1:]],
                                      env=env))

    def forward_signal(signum, _frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, forward_signal)
    signal.signal(signal.SIGINT, forward_signal)

    failed = False
    while procs:
        for p in list(procs):
            rc = p.poll()
            if rc is None:
                continue
            procs.remove(p)
            if rc != 0 and not failed:
                failed = True
                print(f"worker pid {p.pid} exited with {rc}, stopping the others", file=sys.stderr, flush=True)
                for q in procs:
                    q.terminate()
        time.sleep(1.0)
    sys.exit(1 if failed else 0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--lookback", type=int, default=168)
    ap.add_argument("--horizon", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    if args.worker:
        run_worker(args)
    else:
        launch(args)


if __name__ == "__main__":
    main()
