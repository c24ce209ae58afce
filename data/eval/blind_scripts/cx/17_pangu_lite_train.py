"""Pangu-lite: 3D window transformer over pressure levels + surface, 1.5 deg ERA5.

Upper-air input: (B, 5, 13, 121, 240) for z, q, t, u, v on 13 levels.
Surface input:   (B, 4, 121, 240) for msl, u10, v10, t2m.
Predicts the 6 h increment; evaluated by 5-day autoregressive rollouts.
"""
import argparse
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import xarray as xr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

UPPER = ["geopotential", "specific_humidity", "temperature", "u_component_of_wind", "v_component_of_wind"]
SURFACE = ["mean_sea_level_pressure", "10m_u_component_of_wind", "10m_v_component_of_wind", "2m_temperature"]
LEVELS = [50, 100, 150, 200, 250, 300, 400, 500, 600, 700, 850, 925, 1000]

log = logging.getLogger(__name__)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--zarr", default="/data/wb2/1959-2022-6h-240x121_equiangular_with_poles_conservative.zarr")
    p.add_argument("--work_dir", default="/data/experiments/pangu_lite")
    p.add_argument("--train_start", default="1979-01-01")
    p.add_argument("--train_end", default="2015-12-31")
    p.add_argument("--valid_start", default="2018-01-01")
    p.add_argument("--valid_end", default="2018-12-31")
    p.add_argument("--dim", type=int, default=192)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--rollout_days", type=int, default=5)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


def open_era5(path, start, end):
    ds = xr.open_zarr(path, consolidated=True).sel(time=slice(start, end), level=LEVELS)
    return ds


def normalisation_stats(args):
    """Per-variable (and per-level) mean/std over the training period, cached next to the run."""
    cache = os.path.join(args.work_dir, "norm_stats.npz")
    if os.path.exists(cache):
        s = np.load(cache)
        return {k: s[k] for k in s.files}
    ds = open_era5(args.zarr, args.train_start, args.train_end)
    # subsample every 5th day to keep this cheap
    ds = ds.isel(time=slice(0, None, 20))
    up = ds[UPPER].to_array("var")
    sf = ds[SURFACE].to_array("var")
    stats = {
        "upper_mean": up.mean(("time", "latitude", "longitude")).values.astype(np.float32),
        "upper_std": up.std(("time", "latitude", "longitude")).values.astype(np.float32),
        "surf_mean": sf.mean(("time", "latitude", "longitude")).values.astype(np.float32),
        "surf_std": sf.std(("time", "latitude", "longitude")).values.astype(np.float32),
    }
    os.makedirs(args.work_dir, exist_ok=True)
    np.savez(cache, **stats)
    return stats


class PanguWindows(Dataset):
    def __init__(self, ds, stats, n_steps):
        self.up = ds[UPPER].to_array("var").transpose("time", "var", "level", "latitude", "longitude")
        self.sf = ds[SURFACE].to_array("var").transpose("time", "var", "latitude", "longitude")
        self.n_steps = n_steps
        self.um = stats["upper_mean"][:, :, None, None]
        self.us = stats["upper_std"][:, :, None, None]
        self.sm = stats["surf_mean"][:, None, None]
        self.ss = stats["surf_std"][:, None, None]

    def __len__(self):
        return self.up.sizes["time"] - self.n_steps

    def __getitem__(self, i):
        sl = slice(i, i + self.n_steps + 1)
        up = (self.up.isel(time=sl).values - self.um) / self.us
        sf = (self.sf.isel(time=sl).values - self.sm) / self.ss
        return torch.from_numpy(up.astype(np.float32)), torch.from_numpy(sf.astype(np.float32))


class WindowAttention3D(nn.Module):
    def __init__(self, dim, heads, window=(2, 6, 12)):
        super().__init__()
        self.window = window
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        n = window[0] * window[1] * window[2]
        self.rel_bias = nn.Parameter(torch.zeros(heads, n, n))

    def forward(self, x):
        B, Z, H, W, C = x.shape
        wz, wh, ww = self.window
        x = x.view(B, Z // wz, wz, H // wh, wh, W // ww, ww, C)
        x = x.permute(0, 1, 3, 5, 2, 4, 6, 7).reshape(-1, wz * wh * ww, C)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.rel_bias.to(q.dtype))
        out = self.proj(out.transpose(1, 2).flatten(2))
        out = out.view(B, Z // wz, H // wh, W // ww, wz, wh, ww, C).permute(0, 1, 4, 2, 5, 3, 6, 7)
        return out.reshape(B, Z, H, W, C)


class EarthBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.n1 = nn.LayerNorm(dim)
        self.attn = WindowAttention3D(dim, heads)
        self.n2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.mlp(self.n2(x))


class PanguLite(nn.Module):
    """Patch (2,4,4) upper air + (4,4) surface -> 8 pressure slabs x 30 x 60 tokens."""

    def __init__(self, dim=192, depth=8, heads=6):
        super().__init__()
        self.pad_up = (0, 0, 0, 0, 0, 1)  # 13 -> 14 levels
        self.up_embed = nn.Conv3d(5, dim, kernel_size=(2, 4, 4), stride=(2, 4, 4))
        self.sf_embed = nn.Conv2d(4, dim, kernel_size=4, stride=4)
        self.blocks = nn.ModuleList([EarthBlock(dim, heads) for _ in range(depth)])
        self.up_head = nn.ConvTranspose3d(dim, 5, kernel_size=(2, 4, 4), stride=(2, 4, 4))
        self.sf_head = nn.ConvTranspose2d(dim, 4, kernel_size=4, stride=4)

    def forward(self, up, sf):
        # crop 121 -> 120 latitudes for patching, put the pole row back afterwards
        up_c, sf_c = up[..., :120, :], sf[..., :120, :]
        u = self.up_embed(F.pad(up_c, self.pad_up))           # B, C, 7, 30, 60
        s = self.sf_embed(sf_c).unsqueeze(2)                  # B, C, 1, 30, 60
        x = torch.cat([u, s], dim=2).permute(0, 2, 3, 4, 1)   # B, 8, 30, 60, C
        for blk in self.blocks:
            x = blk(x)
        x = x.permute(0, 4, 1, 2, 3)
        du = self.up_head(x[:, :, :7])[:, :, :13]
        ds = self.sf_head(x[:, :, 7])
        up_next = torch.cat([up_c + du, up[..., 120:, :]], dim=-2)
        sf_next = torch.cat([sf_c + ds, sf[..., 120:, :]], dim=-2)
        return up_next, sf_next


def lat_weights(n_lat=121, device="cpu"):
    lat = torch.linspace(-90, 90, n_lat, device=device)
    w = torch.cos(torch.deg2rad(lat)).clamp_min(0)
    return w / w.mean()


def loss_fn(pu, ps, tu, ts, w):
    lu = ((pu - tu).abs() * w[:, None]).mean()
    ls = ((ps - ts).abs() * w[:, None]).mean()
    return lu + 0.25 * ls


@torch.no_grad()
def rollout_eval(model, loader, w, device, n_steps):
    model.eval()
    acc = torch.zeros(n_steps, 2, device=device, dtype=torch.float64)  # [sum mse z500 , count]
    z500 = LEVELS.index(500)
    for up, sf in loader:
        up, sf = up.to(device), sf.to(device)
        u, s = up[:, 0], sf[:, 0]
        for t in range(n_steps):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                u, s = model(u, s)
            u, s = u.float(), s.float()
            err = ((u[:, 0, z500] - up[:, t + 1, 0, z500]) ** 2 * w[:, None]).mean(dim=(-2, -1))
            acc[t, 0] += err.sum().double()
            acc[t, 1] += err.numel()
    dist.all_reduce(acc)
    return torch.sqrt(acc[:, 0] / acc[:, 1])


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(levelname)s %(message)s")

    stats = normalisation_stats(args)
    train_ds = PanguWindows(open_era5(args.zarr, args.train_start, args.train_end), stats, n_steps=1)
    eval_steps = args.rollout_days * 4
    valid_ds = PanguWindows(open_era5(args.zarr, args.valid_start, args.valid_end), stats, n_steps=eval_steps)
    valid_ds = torch.utils.data.Subset(valid_ds, list(range(0, len(valid_ds), 8))[rank::world])  # 00/12 UTC every other day

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, persistent_workers=True)
    valid_dl = DataLoader(valid_ds, batch_size=1, num_workers=4, pin_memory=True)

    model = PanguLite(args.dim, args.depth, args.heads).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=3e-6)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_dl))
    w = lat_weights(device=device)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (up, sf) in enumerate(train_dl):
            up = up.to(device, non_blocking=True)
            sf = sf.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pu, ps = model(up[:, 0], sf[:, 0])
            loss = loss_fn(pu.float(), ps.float(), up[:, 1], sf[:, 1], w)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if it % 100 == 0:
                log.info("ep %d it %d/%d loss %.4f", epoch, it, len(train_dl), loss.item())

        rmse = rollout_eval(model.module, valid_dl, w, device, eval_steps)
        z_std = float(stats["upper_std"][0, LEVELS.index(500)])
        if rank == 0:
            log.info("epoch %d (%.0fs) z500 RMSE d1 %.1f d3 %.1f d5 %.1f", epoch, time.time() - t0,
                     rmse[3] * z_std, rmse[11] * z_std, rmse[eval_steps - 1] * z_std)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.work_dir, "latest.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
