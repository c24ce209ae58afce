#!/usr/bin/env python
"""Cross-machine generalisation for CNC spindle sensors.

All machines are logged on the same 1 min grid over the same period, stored as
one array (n_machines, T, n_sensors). A fraction of machines is held out for
validation so that val error measures transfer to unseen machines.

torchrun --standalone --nproc_per_node=8 04_fleet_holdout_cnc.py --npz /nfs/cnc/fleet_2023.npz
"""
import argparse
import os
import random
from dataclasses import dataclass, asdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


@dataclass
class Config:
    npz: str = "/nfs/cnc/fleet_2023.npz"
    out: str = "runs/cnc_holdout"
    context: int = 512
    horizon: int = 64
    patch: int = 32
    d_model: int = 192
    heads: int = 6
    depth: int = 4
    dropout: float = 0.1
    val_machines: float = 0.2
    stride: int = 16
    batch: int = 64
    epochs: int = 25
    lr: float = 2e-4
    warmup: int = 500
    jitter: float = 0.02
    seed: int = 17
    workers: int = 8


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)


class FleetWindows(Dataset):
    def __init__(self, arr, machines, context, horizon, stride, jitter=0.0):
        # arr: (M, T, S), already normalised per machine & sensor
        self.arr, self.machines = arr, list(machines)
        self.context, self.horizon, self.jitter = context, horizon, jitter
        T = arr.shape[1]
        self.starts = np.arange(0, T - context - horizon + 1, stride)
        self.n_sensors = arr.shape[2]

    def __len__(self):
        return len(self.machines) * self.n_sensors * len(self.starts)

    def __getitem__(self, i):
        per_m = self.n_sensors * len(self.starts)
        m = self.machines[i // per_m]
        s, k = divmod(i % per_m, len(self.starts))
        t0 = self.starts[k]
        w = self.arr[m, t0:t0 + self.context + self.horizon, s].astype(np.float32)
        x, y = w[: self.context].copy(), w[self.context:].copy()
        if self.jitter > 0:
            scale = 1.0 + np.random.randn() * self.jitter
            x *= scale
            y *= scale
        return torch.from_numpy(x), torch.from_numpy(y)


class PatchForecaster(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.patch = c.patch
        n = c.context // c.patch
        self.proj = nn.Linear(c.patch, c.d_model)
        self.pos = nn.Parameter(torch.zeros(1, n, c.d_model))
        nn.init.trunc_normal_(self.pos, std=0.02)
        block = nn.TransformerEncoderLayer(c.d_model, c.heads, 4 * c.d_model, c.dropout,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(block, c.depth)
        self.norm = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(n * c.d_model, c.horizon)

    def forward(self, x):
        loc = x.mean(-1, keepdim=True)
        scale = x.std(-1, keepdim=True).clamp_min(1e-4)
        z = ((x - loc) / scale).unfold(-1, self.patch, self.patch)
        z = self.norm(self.body(self.proj(z) + self.pos))
        return self.head(z.flatten(1)) * scale + loc


def normalise(arr):
    mu = arr.mean(axis=1, keepdims=True)
    sd = arr.std(axis=1, keepdims=True) + 1e-6
    return (arr - mu) / sd


def lr_lambda(warmup, total):
    def f(step):
        if step < warmup:
            return (step + 1) / warmup
        prog = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1 + np.cos(np.pi * min(prog, 1.0)))
    return f


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    acc = torch.zeros(3, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        p = model(x)
        acc[0] += F.mse_loss(p, y, reduction="sum")
        acc[1] += F.l1_loss(p, y, reduction="sum")
        acc[2] += y.numel()
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    ap = argparse.ArgumentParser()
    for k, v in asdict(Config()).items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=v)
    cfg = Config(**vars(ap.parse_args()))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # different seed per rank so jitter/dropout differ between replicas
    seed_everything(cfg.seed + rank)

    arr = normalise(np.load(cfg.npz)["sensors"])
    machine_ids = list(range(arr.shape[0]))
    random.shuffle(machine_ids)
    n_val = max(1, int(len(machine_ids) * cfg.val_machines))
    val_ids, train_ids = sorted(machine_ids[:n_val]), sorted(machine_ids[n_val:])

    train_ds = FleetWindows(arr, train_ids, cfg.context, cfg.horizon, cfg.stride, cfg.jitter)
    val_ds = FleetWindows(arr, val_ids, cfg.context, cfg.horizon, cfg.context)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=cfg.batch, sampler=train_sampler,
                          num_workers=cfg.workers, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=4 * cfg.batch, sampler=val_sampler,
                        num_workers=cfg.workers, pin_memory=True)

    model = DDP(PatchForecaster(cfg).to(device), device_ids=[local_rank])
    lr = cfg.lr * (cfg.batch * world) / 256
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    total = cfg.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.warmup, total))

    tb = SummaryWriter(cfg.out) if rank == 0 else None
    if rank == 0:
        print(f"{len(train_ids)} train machines, {len(val_ids)} val machines, lr={lr:.2e}")

    best = float("inf")
    step = 0
    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.smooth_l1_loss(model(x), y, beta=0.5)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 3.0)
            opt.step()
            sched.step()
            step += 1
            if tb is not None and step % 50 == 0:
                tb.add_scalar("train/loss", loss.item(), step)

        mse, mae = validate(model, val_dl, device)
        if rank == 0:
            tb.add_scalar("val/mse", mse, epoch)
            tb.add_scalar("val/mae", mae, epoch)
            print(f"epoch {epoch} step {step} val mse {mse:.4f} mae {mae:.4f}", flush=True)
            if mse < best:
                best = mse
                torch.save({"model": model.module.state_dict(), "cfg": asdict(cfg),
                            "val_machines": val_ids, "epoch": epoch},
                           os.path.join(cfg.out, "best.pt"))

    if tb is not None:
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
