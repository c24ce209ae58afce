"""PatchTST-style load forecaster on the substation metering archive.

Volcano Job (svc + env plugins), one task "worker" with replicas: 2, 8 GPUs per
pod. The svc plugin exports VC_WORKER_HOSTS and VC_TASK_INDEX:

    command:
      - sh
      - -c
      - |
        MASTER=$(echo ${VC_WORKER_HOSTS} | cut -d, -f1)
        torchrun --nnodes=2 --nproc_per_node=8 --node_rank=${VC_TASK_INDEX} \
          --master_addr=${MASTER} --master_port=23456 \
          forecast.py --data /data/meter/2019-2024.npy --out /output/patchtst-h96
"""
import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_parser():
    p = argparse.ArgumentParser("patchtst")
    p.add_argument("--data", required=True, help="float32 array [T, n_series]")
    p.add_argument("--out", required=True)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--horizon", type=int, default=96)
    p.add_argument("--patch", type=int, default=16)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--local_rank", type=int, default=0)
    return p


class Windows(Dataset):
    """Channel-independent windows: every (series, start) pair is one sample."""

    def __init__(self, arr, context, horizon, stride):
        self.arr = arr
        self.context, self.horizon = context, horizon
        self.starts = np.arange(0, arr.shape[0] - context - horizon + 1, stride)
        self.n_series = arr.shape[1]

    def __len__(self):
        return len(self.starts) * self.n_series

    def __getitem__(self, i):
        s, c = self.starts[i // self.n_series], i % self.n_series
        w = self.arr[s:s + self.context + self.horizon, c]
        return torch.from_numpy(w[: self.context].copy()), torch.from_numpy(w[self.context:].copy())


class RevIN(nn.Module):
    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        sd = x.std(-1, keepdim=True) + 1e-5
        return (x - mu) / sd, (mu, sd)


class PatchTST(nn.Module):
    def __init__(self, context, horizon, patch, d_model, layers, heads=8):
        super().__init__()
        self.patch = patch
        n_patch = context // patch
        self.revin = RevIN()
        self.embed = nn.Linear(patch, d_model)
        self.pos = nn.Parameter(torch.zeros(1, n_patch, d_model))
        enc = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.1, batch_first=True,
                                         norm_first=True)
        self.encoder = nn.TransformerEncoder(enc, layers)
        self.head = nn.Linear(n_patch * d_model, horizon)
        nn.init.trunc_normal_(self.pos, std=0.02)

    def forward(self, x):
        x, (mu, sd) = self.revin(x)
        p = x.unfold(-1, self.patch, self.patch)          # B, n_patch, patch
        h = self.encoder(self.embed(p) + self.pos)
        y = self.head(h.flatten(1))
        return y * sd + mu


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(3, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        pred = model(x)
        acc[0] += ((pred - y) ** 2).sum()
        acc[1] += (pred - y).abs().sum()
        acc[2] += y.numel()
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    args = get_parser().parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    arr = np.load(args.data, mmap_mode="r")
    n = arr.shape[0]
    n_train, n_val = int(0.7 * n), int(0.1 * n)
    train = np.asarray(arr[:n_train], dtype=np.float32)
    val = np.asarray(arr[n_train - args.context:n_train + n_val], dtype=np.float32)
    train_ds = Windows(train, args.context, args.horizon, stride=1)
    val_ds = Windows(val, args.context, args.horizon, stride=args.horizon)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=42, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                          num_workers=4, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=1024, sampler=val_sampler, num_workers=4)

    model = PatchTST(args.context, args.horizon, args.patch, args.d_model, args.layers).to(device)
    model = DDP(model, device_ids=[args.local_rank])
    lr = args.lr * math.sqrt(world * args.batch_size / 256)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total, pct_start=0.1)

    os.makedirs(args.out, exist_ok=True)
    best = float("inf")
    patience, bad = 8, 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(run)
        mse, mae = evaluate(model.module, val_dl, device)
        if rank == 0:
            print(json.dumps({"epoch": epoch, "train_mse": (run[0] / run[1]).item(), "val_mse": mse,
                              "val_mae": mae, "sec": round(time.time() - t0, 1)}), flush=True)
        if mse < best:
            best, bad = mse, 0
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "args": vars(args), "epoch": epoch},
                           os.path.join(args.out, "best.pt"))
        else:
            bad += 1
            if bad >= patience:
                if rank == 0:
                    print(f"early stop at epoch {epoch}", flush=True)
                break
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
