#!/usr/bin/env python
# PatchTST (channel-independent patch transformer) for multivariate long-horizon forecasting.
# Data: a CSV with a date column followed by N numeric channels (ETT / Weather / Electricity layout).
import argparse
import math
import os
import time
from contextlib import nullcontext

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    ap = argparse.ArgumentParser("patchtst")
    ap.add_argument("--csv", default="data/weather.csv")
    ap.add_argument("--seq-len", type=int, default=336)
    ap.add_argument("--pred-len", type=int, default=96)
    ap.add_argument("--patch-len", type=int, default=16)
    ap.add_argument("--stride", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--n-heads", type=int, default=16)
    ap.add_argument("--e-layers", type=int, default=3)
    ap.add_argument("--dropout", type=float, default=0.2)
    ap.add_argument("--batch-size", type=int, default=32, help="micro-batch per GPU")
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--base-lr", type=float, default=1e-4, help="lr for a global batch of 128")
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--patience", type=int, default=10)
    ap.add_argument("--ckpt-dir", default="checkpoints/patchtst")
    ap.add_argument("--no-wandb", action="store_true")
    return ap.parse_args()


class WindowDataset(Dataset):
    """Sliding windows over a (T, C) array that was scaled with train statistics."""

    def __init__(self, arr, seq_len, pred_len):
        self.x = torch.from_numpy(arr).float()
        self.seq_len, self.pred_len = seq_len, pred_len

    def __len__(self):
        return self.x.shape[0] - self.seq_len - self.pred_len + 1

    def __getitem__(self, i):
        s, m = i, i + self.seq_len
        return self.x[s:m], self.x[m:m + self.pred_len]


def load_splits(path, seq_len, pred_len):
    df = pd.read_csv(path)
    values = df.iloc[:, 1:].to_numpy(dtype=np.float32)
    n = len(values)
    n_train, n_test = int(n * 0.7), int(n * 0.2)
    n_val = n - n_train - n_test
    borders = [(0, n_train), (n_train - seq_len, n_train + n_val), (n - n_test - seq_len, n)]
    mu = values[:n_train].mean(0)
    sd = values[:n_train].std(0) + 1e-5
    values = (values - mu) / sd
    return [WindowDataset(values[a:b], seq_len, pred_len) for a, b in borders], values.shape[1]


class RevIN(nn.Module):
    def __init__(self, c, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.w = nn.Parameter(torch.ones(c))
        self.b = nn.Parameter(torch.zeros(c))

    def norm(self, x):
        self.mean = x.mean(1, keepdim=True).detach()
        self.std = torch.sqrt(x.var(1, keepdim=True, unbiased=False) + self.eps).detach()
        return (x - self.mean) / self.std * self.w + self.b

    def denorm(self, y):
        return ((y - self.b) / (self.w + self.eps * self.eps)) * self.std + self.mean


class PatchTST(nn.Module):
    def __init__(self, c_in, seq_len, pred_len, patch_len, stride, d_model, n_heads, e_layers, dropout):
        super().__init__()
        self.patch_len, self.stride = patch_len, stride
        n_patch = (seq_len - patch_len) // stride + 2  # +1 for end padding
        self.revin = RevIN(c_in)
        self.pad = nn.ReplicationPad1d((0, stride))
        self.proj = nn.Linear(patch_len, d_model)
        self.pos = nn.Parameter(torch.randn(1, n_patch, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout,
                                           batch_first=True, norm_first=True, activation="gelu")
        self.encoder = nn.TransformerEncoder(layer, e_layers)
        self.head = nn.Sequential(nn.Flatten(-2), nn.Dropout(dropout), nn.Linear(n_patch * d_model, pred_len))

    def forward(self, x):  # x: (B, L, C)
        B, L, C = x.shape
        x = self.revin.norm(x)
        x = x.permute(0, 2, 1)                       # B, C, L
        x = self.pad(x).unfold(-1, self.patch_len, self.stride)  # B, C, P, patch
        z = self.proj(x).reshape(B * C, x.shape[2], -1) + self.pos
        z = self.encoder(z).reshape(B, C, x.shape[2], -1)
        y = self.head(z).permute(0, 2, 1)            # B, H, C
        return self.revin.denorm(y)


def shard(ds, rank, world):
    # contiguous, non-overlapping eval shards; every window is scored exactly once
    per = math.ceil(len(ds) / world)
    return Subset(ds, range(rank * per, min(len(ds), (rank + 1) * per)))


@torch.no_grad()
def evaluate(net, ds, rank, world, device, bs):
    net.eval()
    loader = DataLoader(shard(ds, rank, world), batch_size=bs, shuffle=False, num_workers=4, pin_memory=True)
    acc = torch.zeros(3, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            p = net(x)
        p = p.float()
        acc[0] += ((p - y) ** 2).sum().double()
        acc[1] += (p - y).abs().sum().double()
        acc[2] += y.numel()
    dist.all_reduce(acc, op=dist.ReduceOp.SUM)
    net.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(2021)
    is_main = rank == 0

    run = None
    if is_main and not args.no_wandb:
        import wandb
        run = wandb.init(project="patchtst", config=vars(args))

    (train_ds, val_ds, test_ds), n_ch = load_splits(args.csv, args.seq_len, args.pred_len)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = PatchTST(n_ch, args.seq_len, args.pred_len, args.patch_len, args.stride,
                     args.d_model, args.n_heads, args.e_layers, args.dropout).to(device)
    net = DDP(model, device_ids=[local_rank])

    global_bs = args.batch_size * args.accum * world
    lr = args.base_lr * global_bs / 128
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    steps_per_epoch = len(loader) // args.accum
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, epochs=args.epochs,
                                                steps_per_epoch=steps_per_epoch, pct_start=0.3)
    crit = nn.MSELoss()

    os.makedirs(args.ckpt_dir, exist_ok=True)
    last = os.path.join(args.ckpt_dir, "last.pt")
    start, best, bad = 0, float("inf"), 0
    if os.path.exists(last):
        st = torch.load(last, map_location="cpu")
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        start, best, bad = st["epoch"] + 1, st["best"], st["bad"]
        if is_main:
            print(f"resumed from epoch {st['epoch']}")

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        t0, tot, cnt = time.time(), torch.zeros((), device=device), 0
        opt.zero_grad(set_to_none=True)
        for i, (x, y) in enumerate(loader):
            if i >= steps_per_epoch * args.accum:
                break
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            sync = (i + 1) % args.accum == 0
            with (nullcontext() if sync else net.no_sync()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = crit(net(x).float(), y) / args.accum
                loss.backward()
            tot += loss.detach() * args.accum
            cnt += 1
            if sync:
                torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)

        dist.all_reduce(tot)
        train_loss = tot.item() / (cnt * world)
        v_mse, v_mae = evaluate(model, val_ds, rank, world, device, 2 * args.batch_size)
        improved = v_mse < best
        best = min(best, v_mse)
        bad = 0 if improved else bad + 1

        if is_main:
            print(f"ep {epoch:3d} train {train_loss:.4f} val mse {v_mse:.4f} mae {v_mae:.4f} "
                  f"lr {sched.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)
            if run is not None:
                run.log({"train/loss": train_loss, "val/mse": v_mse, "val/mae": v_mae, "epoch": epoch})
            state = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                     "epoch": epoch, "best": best, "bad": bad}
            torch.save(state, last + ".tmp")
            os.replace(last + ".tmp", last)
            if improved:
                torch.save(model.state_dict(), os.path.join(args.ckpt_dir, "best.pt"))
        dist.barrier()
        if bad >= args.patience:
            break

    best_sd = torch.load(os.path.join(args.ckpt_dir, "best.pt"), map_location="cpu")
    model.load_state_dict(best_sd)
    t_mse, t_mae = evaluate(model, test_ds, rank, world, device, 2 * args.batch_size)
    if is_main:
        print(f"test mse {t_mse:.4f} mae {t_mae:.4f}")
        if run is not None:
            run.summary.update({"test/mse": t_mse, "test/mae": t_mae})
            run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
