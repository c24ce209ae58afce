#!/usr/bin/env python
"""Multi-horizon load forecasting (electricity, 370 meters) with a small Transformer encoder.

Trained on the CPU partition: one launcher per node, which spawns one worker per
NUMA domain and joins a gloo process group across all nodes.

    # node 0 .. node 3 (pdsh / clush)
    python 15_gloo_spawn_forecast.py --nnodes 4 --node-rank $NODE_RANK --nproc-per-node 4 \
        --master-addr cpu-a01 --data /nfs/ts/electricity.npy --out /nfs/ts/runs/elec_tf
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--nproc-per-node", type=int, default=4)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=29555)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--context", type=int, default=168)
    p.add_argument("--horizon", type=int, default=24)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--threads", type=int, default=16)
    return p.parse_args()


class Windows(Dataset):
    """Sliding windows over a [T, N] array of per-meter series, scaled per meter."""

    def __init__(self, series, context, horizon, start, end):
        self.x = torch.from_numpy(series[start:end]).float()
        self.context, self.horizon = context, horizon
        self.n_t = self.x.shape[0] - context - horizon + 1
        self.n_series = self.x.shape[1]

    def __len__(self):
        return self.n_t * self.n_series

    def __getitem__(self, idx):
        t, s = divmod(idx, self.n_series)
        window = self.x[t:t + self.context + self.horizon, s]
        return window[:self.context].unsqueeze(-1), window[self.context:], s


class Forecaster(nn.Module):
    def __init__(self, n_series, context, horizon, d_model, layers):
        super().__init__()
        self.inp = nn.Linear(1, d_model)
        self.series_emb = nn.Embedding(n_series, d_model)
        self.pos = nn.Parameter(torch.zeros(1, context, d_model))
        enc_layer = nn.TransformerEncoderLayer(d_model, 4, 4 * d_model, dropout=0.1, batch_first=True,
                                               norm_first=True)
        self.encoder = nn.TransformerEncoder(enc_layer, layers)
        self.head = nn.Linear(d_model * context, horizon)

    def forward(self, x, sid):
        h = self.inp(x) + self.pos + self.series_emb(sid).unsqueeze(1)
        h = self.encoder(h)
        return self.head(h.flatten(1))


def load_series(path):
    arr = np.load(path).astype(np.float32)  # [T, N] hourly kWh
    n_train = int(arr.shape[0] * 0.8)
    mu = arr[:n_train].mean(0, keepdims=True)
    sd = arr[:n_train].std(0, keepdims=True) + 1e-5
    return (arr - mu) / sd, n_train


def worker(local_rank, args):
    global_rank = args.node_rank * args.nproc_per_node + local_rank
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        backend="gloo",
        init_method=f"tcp://{args.master_addr}:{args.master_port}",
        rank=global_rank,
        world_size=args.nproc_per_node,
    )
    world = dist.get_world_size()
    torch.manual_seed(0)

    series, n_train = load_series(args.data)
    train_ds = Windows(series, args.context, args.horizon, 0, n_train)
    val_ds = Windows(series, args.context, args.horizon, n_train - args.context, series.shape[0])
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=2,
                          drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=1024, sampler=val_sampler, num_workers=2)

    model = DDP(Forecaster(series.shape[1], args.context, args.horizon, args.d_model, args.layers))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr * world ** 0.5, weight_decay=1e-2)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_dl))
    loss_fn = nn.SmoothL1Loss()

    if global_rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world={world} train_windows={len(train_ds)} val_windows={len(val_ds)}", flush=True)

    best = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (x, y, sid) in enumerate(train_dl):
            loss = loss_fn(model(x, sid), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            if global_rank == 0 and step % 200 == 0:
                print(f"ep {epoch} step {step}/{len(train_dl)} loss {loss.item():.4f}", flush=True)

        model.eval()
        err = torch.zeros(3, dtype=torch.float64)  # abs err, sq err, count
        with torch.no_grad():
            for x, y, sid in val_dl:
                pred = model.module(x, sid)
                err[0] += (pred - y).abs().sum().item()
                err[1] += ((pred - y) ** 2).sum().item()
                err[2] += y.numel()
        dist.all_reduce(err)
        mae, rmse = (err[0] / err[2]).item(), (err[1] / err[2]).sqrt().item()

        if global_rank == 0:
            print(f"epoch {epoch} val MAE {mae:.4f} RMSE {rmse:.4f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "mae": mae},
                       os.path.join(args.out, "last.pt"))
            if mae < best:
                best = mae
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    mp.spawn(worker, args=(args,), nprocs=args.nproc_per_node, join=True)
