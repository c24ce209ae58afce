"""WeatherBench-style 5.625deg ERA5 forecasting with a small U-Net.

Predicts the state at t + lead_time from the state at t (z500, t850, t2m, u10, v10).

    torchrun --nnodes=1 --nproc_per_node=4 04_era5_unet.py --config configs/unet_era5.yaml
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import xarray as xr
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DEFAULTS = {
    "data_dir": "/datasets/weatherbench/5.625deg",
    "stats_file": "/datasets/weatherbench/5.625deg/stats_1979_2015.json",
    "variables": ["z500", "t850", "t2m", "u10", "v10"],
    "train_years": [1979, 2015],
    "val_years": [2016, 2016],
    "lead_time_h": 72,
    "base_channels": 64,
    "batch_size": 16,
    "epochs": 50,
    "lr": 5e-4,
    "weight_decay": 1e-5,
    "num_workers": 6,
    "out_dir": "runs/era5_unet",
}


class ERA5Pairs(Dataset):
    def __init__(self, data_dir, variables, years, lead_time_h, mean, std):
        arrays = []
        for v in variables:
            ds = xr.open_mfdataset(os.path.join(data_dir, v, "*.nc"), combine="by_coords")
            ds = ds.sel(time=slice(str(years[0]), str(years[1])))
            arrays.append(ds[list(ds.data_vars)[0]].values.astype(np.float32))
            self.lat = ds["lat"].values
        x = np.stack(arrays, axis=1)  # [T, C, H, W]
        x = (x - mean[None, :, None, None]) / std[None, :, None, None]
        self.x = torch.from_numpy(x)
        self.lead = lead_time_h  # hourly data
        self.n = self.x.shape[0] - self.lead

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.x[i], self.x[i + self.lead]


def conv_block(cin, cout):
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, padding_mode="circular"),
        nn.GroupNorm(8, cout), nn.GELU(),
        nn.Conv2d(cout, cout, 3, padding=1, padding_mode="circular"),
        nn.GroupNorm(8, cout), nn.GELU(),
    )


class UNet(nn.Module):
    def __init__(self, channels, base=64):
        super().__init__()
        self.enc1 = conv_block(channels, base)
        self.enc2 = conv_block(base, base * 2)
        self.enc3 = conv_block(base * 2, base * 4)
        self.up2 = nn.ConvTranspose2d(base * 4, base * 2, 2, stride=2)
        self.dec2 = conv_block(base * 4, base * 2)
        self.up1 = nn.ConvTranspose2d(base * 2, base, 2, stride=2)
        self.dec1 = conv_block(base * 2, base)
        self.out = nn.Conv2d(base, channels, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        e3 = self.enc3(F.max_pool2d(e2, 2))
        d2 = self.dec2(torch.cat([self.up2(e3), e2], 1))
        d1 = self.dec1(torch.cat([self.up1(d2), e1], 1))
        return x + self.out(d1)  # residual: predict the tendency


def lat_weights(lat, device):
    w = np.cos(np.deg2rad(lat))
    w = w / w.mean()
    return torch.tensor(w, dtype=torch.float32, device=device)[None, None, :, None]


@torch.no_grad()
def validate(model, loader, w_lat, std, device):
    model.eval()
    sq_err = torch.zeros(std.numel(), device=device)
    count = 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(x)
        err = (pred.float() - y) * std[None, :, None, None]
        sq_err += (err ** 2 * w_lat).mean(dim=(2, 3)).sum(0)
        count += x.size(0)
    rmse = (sq_err / count).sqrt()
    return rmse.cpu().numpy()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--resume", default=None)
    cli = ap.parse_args()
    cfg = dict(DEFAULTS)
    if cli.config:
        with open(cli.config) as f:
            cfg.update(yaml.safe_load(f))

    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    with open(cfg["stats_file"]) as f:
        stats = json.load(f)
    mean = np.array([stats[v]["mean"] for v in cfg["variables"]], dtype=np.float32)
    std = np.array([stats[v]["std"] for v in cfg["variables"]], dtype=np.float32)

    train_ds = ERA5Pairs(cfg["data_dir"], cfg["variables"], cfg["train_years"],
                         cfg["lead_time_h"], mean, std)
    val_ds = ERA5Pairs(cfg["data_dir"], cfg["variables"], cfg["val_years"],
                       cfg["lead_time_h"], mean, std)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=train_sampler,
                              num_workers=cfg["num_workers"], pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=cfg["batch_size"], sampler=val_sampler,
                            num_workers=cfg["num_workers"], pin_memory=True)

    n_ch = len(cfg["variables"])
    model = UNet(n_ch, cfg["base_channels"]).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    total_steps = cfg["epochs"] * len(train_loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg["lr"], total_steps=total_steps,
                                                pct_start=0.05)
    w_lat = lat_weights(train_ds.lat, device)
    std_t = torch.tensor(std, device=device)

    start_epoch, best = 0, float("inf")
    if cli.resume:
        ckpt = torch.load(cli.resume, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]

    os.makedirs(cfg["out_dir"], exist_ok=True)
    for epoch in range(start_epoch, cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_acc = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(x)
            loss = ((pred.float() - y) ** 2 * w_lat).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            loss_acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(loss_acc)
        train_loss = (loss_acc[0] / loss_acc[1]).item()

        rmse = validate(model, val_loader, w_lat, std_t, device)
        score = float(rmse[cfg["variables"].index("z500")])
        if rank == 0:
            per_var = " ".join(f"{v}={r:.3f}" for v, r in zip(cfg["variables"], rmse))
            print(f"[{epoch:03d}] train {train_loss:.4f} | val rmse {per_var} | "
                  f"{time.time() - t0:.0f}s", flush=True)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                     "sched": sched.state_dict(), "epoch": epoch, "best": min(best, score),
                     "cfg": cfg}
            torch.save(state, os.path.join(cfg["out_dir"], "last.pt"))
            if score < best:
                torch.save(state, os.path.join(cfg["out_dir"], "best.pt"))
        best = min(best, score)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
