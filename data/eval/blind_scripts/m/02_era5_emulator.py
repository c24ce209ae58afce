"""
Data-driven weather emulator: predict the ERA5 state 6 h ahead from the current state.
5.625 deg grid (32 x 64), 2 surface fields + 3 pressure-level fields x 3 levels = 11 channels
(+ 3 constant fields: orography, land-sea mask, cos(lat)).

Data: one HDF5 file per year, dataset "fields" with shape (T, C, 32, 64) at 6-hourly steps,
normalisation stats in stats.npz (mean/std per channel).

    torchrun --nproc_per_node=4 02_era5_emulator.py --config configs/emu_5p625.yaml
"""
import argparse
import csv
import os
import time
from datetime import datetime

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

VARS = ["t2m", "u10", "z500", "z700", "z850", "t500", "t700", "t850", "q500", "q700", "q850"]

DEFAULTS = dict(
    data_dir="/scratch/era5_5p625",
    train_years=list(range(1979, 2016)),
    val_years=[2016, 2017],
    lead_steps=1,
    batch_size=32,
    lr=5e-4,
    epochs=60,
    hidden=128,
    n_blocks=12,
    workers=4,
    out_dir="runs/emu",
)


class ERA5Pairs(Dataset):
    """(x_t, x_{t+lead}) pairs across several yearly HDF5 files. Files are opened lazily per worker."""

    def __init__(self, data_dir, years, lead, mean, std):
        self.paths = [os.path.join(data_dir, f"{y}.h5") for y in years]
        self.lead = lead
        self.mean = mean[:, None, None].astype(np.float32)
        self.std = std[:, None, None].astype(np.float32)
        self.index = []
        for fi, p in enumerate(self.paths):
            with h5py.File(p, "r") as f:
                T = f["fields"].shape[0]
            self.index.extend((fi, t) for t in range(T - lead))
        self._handles = {}

    def _get(self, fi):
        if fi not in self._handles:
            self._handles[fi] = h5py.File(self.paths[fi], "r")["fields"]
        return self._handles[fi]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        fi, t = self.index[i]
        ds = self._get(fi)
        x = (ds[t] - self.mean) / self.std
        y = (ds[t + self.lead] - self.mean) / self.std
        return torch.from_numpy(x.astype(np.float32)), torch.from_numpy(y.astype(np.float32))


class PeriodicConv(nn.Module):
    """Conv with circular padding in longitude and replicate padding in latitude."""

    def __init__(self, cin, cout, k=3):
        super().__init__()
        self.p = k // 2
        self.conv = nn.Conv2d(cin, cout, k)

    def forward(self, x):
        x = F.pad(x, (self.p, self.p, 0, 0), mode="circular")
        x = F.pad(x, (0, 0, self.p, self.p), mode="replicate")
        return self.conv(x)


class ResBlock(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.c1 = PeriodicConv(ch, ch)
        self.c2 = PeriodicConv(ch, ch)
        self.n1 = nn.GroupNorm(8, ch)
        self.n2 = nn.GroupNorm(8, ch)

    def forward(self, x):
        h = F.gelu(self.n1(self.c1(x)))
        h = self.n2(self.c2(h))
        return F.gelu(x + h)


class Emulator(nn.Module):
    def __init__(self, n_vars, n_const, hidden, n_blocks):
        super().__init__()
        self.inp = PeriodicConv(n_vars + n_const, hidden)
        self.blocks = nn.Sequential(*[ResBlock(hidden) for _ in range(n_blocks)])
        self.out = PeriodicConv(hidden, n_vars)

    def forward(self, x, const):
        h = self.inp(torch.cat([x, const.expand(x.shape[0], -1, -1, -1)], dim=1))
        h = self.blocks(h)
        return x + self.out(h)  # predict the tendency


def lat_weights(nlat, device):
    lat = torch.linspace(-87.1875, 87.1875, nlat, device=device)
    w = torch.cos(torch.deg2rad(lat))
    return (w / w.mean()).view(1, 1, nlat, 1)


def load_constants(data_dir, device):
    c = np.load(os.path.join(data_dir, "constants.npz"))
    oro = (c["orography"] - c["orography"].mean()) / c["orography"].std()
    arr = np.stack([oro, c["lsm"], c["coslat"]]).astype(np.float32)
    return torch.from_numpy(arr)[None].to(device)


@torch.no_grad()
def evaluate(model, loader, const, w, std, device):
    model.eval()
    se = torch.zeros(len(VARS), device=device)
    n = torch.zeros(1, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        pred = model(x, const)
        se += ((pred - y) ** 2 * w).mean(dim=(2, 3)).sum(0)
        n += x.shape[0]
    dist.all_reduce(se)
    dist.all_reduce(n)
    model.train()
    rmse = torch.sqrt(se / n).cpu().numpy() * std  # back to physical units
    return dict(zip(VARS, rmse))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--resume", default=None)
    cli = ap.parse_args()
    cfg = dict(DEFAULTS)
    if cli.config:
        with open(cli.config) as f:
            cfg.update(yaml.safe_load(f) or {})

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device(f"cuda:{local_rank}")

    stats = np.load(os.path.join(cfg["data_dir"], "stats.npz"))
    mean, std = stats["mean"], stats["std"]
    train_ds = ERA5Pairs(cfg["data_dir"], cfg["train_years"], cfg["lead_steps"], mean, std)
    val_ds = ERA5Pairs(cfg["data_dir"], cfg["val_years"], cfg["lead_steps"], mean, std)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=42)
    # every rank evaluates its own strided slice of the validation years (no padding)
    val_part = Subset(val_ds, list(range(rank, len(val_ds), dist.get_world_size())))
    train_dl = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=train_sampler,
                          num_workers=cfg["workers"], pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_part, batch_size=cfg["batch_size"], shuffle=False,
                        num_workers=cfg["workers"], pin_memory=True)

    const = load_constants(cfg["data_dir"], device)
    w = lat_weights(32, device)
    model = Emulator(len(VARS), const.shape[1], cfg["hidden"], cfg["n_blocks"]).to(device)
    model = DDP(model, device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.05)
    total_steps = cfg["epochs"] * len(train_dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg["lr"], total_steps=total_steps, pct_start=0.05)
    start_epoch = 0
    if cli.resume:
        ck = torch.load(cli.resume, map_location=device)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch = ck["epoch"] + 1

    os.makedirs(cfg["out_dir"], exist_ok=True)
    log_path = os.path.join(cfg["out_dir"], "log.csv")
    if rank == 0 and not os.path.exists(log_path):
        with open(log_path, "w", newline="") as f:
            csv.writer(f).writerow(["epoch", "train_loss", "time"] + [f"rmse_{v}" for v in VARS])

    for epoch in range(start_epoch, cfg["epochs"]):
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for x, y in train_dl:
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            pred = model(x, const)
            loss = ((pred - y) ** 2 * w).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            tot += torch.stack([loss.detach() * x.shape[0], torch.tensor(float(x.shape[0]), device=device)])
        dist.all_reduce(tot)
        train_loss = (tot[0] / tot[1]).item()
        rmse = evaluate(model.module, val_dl, const, w, std, device)
        if rank == 0:
            dt = time.time() - t0
            print(f"[{datetime.now():%H:%M}] ep {epoch} loss {train_loss:.5f} z500 {rmse['z500']:.1f} "
                  f"t850 {rmse['t850']:.3f} ({dt:.0f}s)", flush=True)
            with open(log_path, "a", newline="") as f:
                csv.writer(f).writerow([epoch, train_loss, round(dt, 1)] + [float(rmse[v]) for v in VARS])
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "cfg": cfg},
                       os.path.join(cfg["out_dir"], "ckpt.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
