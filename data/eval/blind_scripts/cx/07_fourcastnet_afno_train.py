#!/usr/bin/env python
"""Train an AFNO (FourCastNet-style) backbone on 0.25 deg ERA5 stored as zarr.

One 6-hourly step is learned; validation reports latitude-weighted RMSE per
variable (physical units) over the validation years and keeps the best model.
"""
import argparse
import logging
import math
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

logger = logging.getLogger("afno")

DEFAULTS = dict(
    zarr_path="/datasets/era5/era5_0p25_6h.zarr",
    stats_path="/datasets/era5/stats/era5_0p25_1979_2015.npz",
    variables=["u10", "v10", "t2m", "sp", "msl", "z500", "t850", "u500", "v500", "r500", "tcwv"],
    train_years=list(range(1979, 2016)),
    valid_years=[2016, 2017],
    patch_size=8,
    embed_dim=768,
    depth=12,
    num_blocks=8,
    batch_size=2,  # per GPU
    lr=5e-4,
    weight_decay=0.05,
    epochs=80,
    num_workers=8,
    out_dir="/scratch/weather/runs/afno",
)


# ----------------------------------------------------------------------------- data
class ERA5Pairs(Dataset):
    """(x_t, x_{t+dt}) pairs, normalised with per-variable training-year statistics."""

    def __init__(self, zarr_path, years, variables, mean, std, dt=1):
        ds = xr.open_zarr(zarr_path, consolidated=True)
        ds = ds.sel(time=ds.time.dt.year.isin(years))
        # FourCastNet drops the southern-most row so that 720 is divisible by the patch size
        self.arr = ds[variables].to_array("channel").transpose("time", "channel", "lat", "lon").isel(lat=slice(0, 720))
        self.lat = ds.lat.values[:720]
        self.mean = mean[:, None, None].astype(np.float32)
        self.std = std[:, None, None].astype(np.float32)
        self.dt = dt

    def __len__(self):
        return self.arr.sizes["time"] - self.dt

    def __getitem__(self, i):
        pair = self.arr.isel(time=[i, i + self.dt]).values.astype(np.float32)
        pair = (pair - self.mean) / self.std
        return torch.from_numpy(pair[0]), torch.from_numpy(pair[1])


def latitude_weights(lat):
    w = np.cos(np.deg2rad(lat))
    return (w / w.mean()).astype(np.float32)


# ----------------------------------------------------------------------------- model
class AFNO2D(nn.Module):
    def __init__(self, dim, num_blocks=8, sparsity=0.01):
        super().__init__()
        assert dim % num_blocks == 0
        self.num_blocks = num_blocks
        self.block_size = dim // num_blocks
        self.sparsity = sparsity
        s = 0.02
        self.w1 = nn.Parameter(s * torch.randn(2, num_blocks, self.block_size, self.block_size))
        self.b1 = nn.Parameter(s * torch.randn(2, num_blocks, self.block_size))
        self.w2 = nn.Parameter(s * torch.randn(2, num_blocks, self.block_size, self.block_size))
        self.b2 = nn.Parameter(s * torch.randn(2, num_blocks, self.block_size))

    @staticmethod
    def _mul(x, w):
        return torch.einsum("...bi,bio->...bo", x, w)

    def forward(self, x):
        dtype = x.dtype
        B, H, W, C = x.shape
        with torch.autocast("cuda", enabled=False):
            x = torch.fft.rfft2(x.float(), dim=(1, 2), norm="ortho")
            x = x.reshape(B, H, W // 2 + 1, self.num_blocks, self.block_size)
            r1 = F.relu(self._mul(x.real, self.w1[0]) - self._mul(x.imag, self.w1[1]) + self.b1[0])
            i1 = F.relu(self._mul(x.imag, self.w1[0]) + self._mul(x.real, self.w1[1]) + self.b1[1])
            r2 = self._mul(r1, self.w2[0]) - self._mul(i1, self.w2[1]) + self.b2[0]
            i2 = self._mul(i1, self.w2[0]) + self._mul(r1, self.w2[1]) + self.b2[1]
            x = F.softshrink(torch.stack([r2, i2], dim=-1), lambd=self.sparsity)
            x = torch.view_as_complex(x).reshape(B, H, W // 2 + 1, C)
            x = torch.fft.irfft2(x, s=(H, W), dim=(1, 2), norm="ortho")
        return x.to(dtype)


class AFNOBlock(nn.Module):
    def __init__(self, dim, num_blocks, mlp_ratio=4.0):
        super().__init__()
        hidden = int(dim * mlp_ratio)
        self.norm1 = nn.LayerNorm(dim)
        self.filter = AFNO2D(dim, num_blocks)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x):
        x = x + self.filter(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class AFNONet(nn.Module):
    def __init__(self, img_size, chans, patch_size, embed_dim, depth, num_blocks):
        super().__init__()
        self.p = patch_size
        self.h, self.w = img_size[0] // patch_size, img_size[1] // patch_size
        self.chans = chans
        self.patch_embed = nn.Conv2d(chans, embed_dim, kernel_size=patch_size, stride=patch_size)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.h, self.w, embed_dim))
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        self.blocks = nn.ModuleList([AFNOBlock(embed_dim, num_blocks) for _ in range(depth)])
        self.head = nn.Linear(embed_dim, chans * patch_size * patch_size, bias=False)

    def forward(self, x):
        B = x.shape[0]
        x = self.patch_embed(x).permute(0, 2, 3, 1) + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        x = self.head(x).reshape(B, self.h, self.w, self.p, self.p, self.chans)
        x = torch.einsum("nhwpqc->nchpwq", x)
        return x.reshape(B, self.chans, self.h * self.p, self.w * self.p)


# ----------------------------------------------------------------------------- eval
@torch.no_grad()
def validate(model, loader, lat_w, std, device):
    model.eval()
    sq_err = torch.zeros(std.numel(), device=device, dtype=torch.float64)
    n = 0
    for x, y in loader:
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(x)
        diff = (pred.float() - y) * std.view(1, -1, 1, 1)
        sq_err += (lat_w.view(1, 1, -1, 1) * diff ** 2).mean(dim=(-2, -1)).sum(0).double()
        n += x.shape[0]
    rmse = torch.sqrt(sq_err / n)
    return rmse.cpu().numpy()


def save_checkpoint(path, model, optimizer, scheduler, epoch, best):
    torch.save(
        {
            "model": model.module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "epoch": epoch,
            "best_rmse": best,
        },
        path,
    )


# ----------------------------------------------------------------------------- main
def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=str, default=None)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    cfg = dict(DEFAULTS)
    if args.config:
        with open(args.config) as f:
            cfg.update(yaml.safe_load(f))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[%(asctime)s r{rank}] %(message)s",
    )
    os.makedirs(cfg["out_dir"], exist_ok=True)

    stats = np.load(cfg["stats_path"])
    var_idx = [list(stats["variables"]).index(v) for v in cfg["variables"]]
    mean, std = stats["mean"][var_idx], stats["std"][var_idx]

    train_set = ERA5Pairs(cfg["zarr_path"], cfg["train_years"], cfg["variables"], mean, std)
    valid_set = ERA5Pairs(cfg["zarr_path"], cfg["valid_years"], cfg["variables"], mean, std)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    valid_sampler = DistributedSampler(valid_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=cfg["batch_size"], sampler=train_sampler,
                              num_workers=cfg["num_workers"], pin_memory=True, drop_last=True,
                              persistent_workers=True)
    valid_loader = DataLoader(valid_set, batch_size=cfg["batch_size"], sampler=valid_sampler,
                              num_workers=cfg["num_workers"], pin_memory=True)

    lat_w = torch.from_numpy(latitude_weights(train_set.lat)).to(device)
    std_t = torch.from_numpy(std.astype(np.float32)).to(device)

    model = AFNONet((720, 1440), len(cfg["variables"]), cfg["patch_size"], cfg["embed_dim"],
                    cfg["depth"], cfg["num_blocks"]).to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg["epochs"])

    start_epoch, best = 0, math.inf
    ckpt_path = os.path.join(cfg["out_dir"], "last.pt")
    if args.resume and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best_rmse"]
        logger.info("resumed from epoch %d", ckpt["epoch"])

    for epoch in range(start_epoch, cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for step, (x, y) in enumerate(train_loader):
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(x)
            loss = F.mse_loss(pred.float(), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
            if step % 200 == 0:
                logger.info("epoch %d step %d loss %.5f", epoch, step, loss.item())
        scheduler.step()
        dist.all_reduce(running)
        train_loss = (running[0] / running[1]).item()

        rmse = validate(model, valid_loader, lat_w, std_t, device)
        score = float(np.mean(rmse / std))  # normalised so every variable counts the same
        if rank == 0:
            msg = " ".join(f"{v}={r:.3f}" for v, r in zip(cfg["variables"], rmse))
            logger.info("epoch %d train %.5f | val %.4f | %s | %.0fs", epoch, train_loss, score, msg, time.time() - t0)
            if score < best:
                best = score
                save_checkpoint(os.path.join(cfg["out_dir"], "best.pt"), model, optimizer, scheduler, epoch, best)
            save_checkpoint(ckpt_path, model, optimizer, scheduler, epoch, best)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
