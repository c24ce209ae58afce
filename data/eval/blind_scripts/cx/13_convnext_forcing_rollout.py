"""ConvNeXt forecaster with prescribed forcings (TOA incident solar radiation,
land-sea mask, orography) on 1.5 deg ERA5, trained with a 2-step rollout and
evaluated with 10-day rollouts (latitude-weighted RMSE + ACC).

Run with:  torchrun --nproc_per_node=4 13_convnext_forcing_rollout.py -c configs/convnext_1p5.yaml
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
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("convnext-wx")


class ERA5WithForcings(Dataset):
    def __init__(self, cfg, start, end, steps):
        ds = xr.open_zarr(cfg["zarr"]).sel(time=slice(start, end))
        st = np.load(cfg["stats"])
        self.prog = ds[cfg["prognostic"]].to_array("v").transpose("time", "v", "lat", "lon")
        self.toa = ds["toa_incident_solar_radiation"].transpose("time", "lat", "lon")
        self.mu = st["mean"][:, None, None].astype(np.float32)
        self.sd = st["std"][:, None, None].astype(np.float32)
        self.toa_scale = float(st["toa_max"])
        self.steps = steps

    def __len__(self):
        return self.prog.sizes["time"] - self.steps

    def __getitem__(self, i):
        sl = slice(i, i + self.steps + 1)
        x = (self.prog.isel(time=sl).values - self.mu) / self.sd
        f = self.toa.isel(time=sl).values / self.toa_scale
        return torch.from_numpy(x.astype(np.float32)), torch.from_numpy(f.astype(np.float32))


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dw = nn.Conv2d(dim, dim, 7, padding=0, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.pw1 = nn.Linear(dim, 4 * dim)
        self.pw2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(1e-6 * torch.ones(dim))

    def forward(self, x):
        h = F.pad(x, (3, 3, 0, 0), mode="circular")
        h = F.pad(h, (0, 0, 3, 3), mode="replicate")
        h = self.dw(h).permute(0, 2, 3, 1)
        h = self.pw2(F.gelu(self.pw1(self.norm(h))))
        return x + (self.gamma * h).permute(0, 3, 1, 2)


class ConvNeXtForecaster(nn.Module):
    def __init__(self, n_prog, static, dim=256, depth=16):
        super().__init__()
        self.register_buffer("static", static)  # (n_static, lat, lon): lsm, orography, cos/sin lat
        cin = n_prog + 1 + static.shape[0]
        self.stem = nn.Conv2d(cin, dim, 1)
        self.blocks = nn.Sequential(*[ConvNeXtBlock(dim) for _ in range(depth)])
        self.head = nn.Conv2d(dim, n_prog, 1)

    def forward(self, x, toa):
        B = x.shape[0]
        inp = torch.cat([x, toa[:, None], self.static.expand(B, -1, -1, -1)], dim=1)
        return x + self.head(self.blocks(self.stem(inp)))

    @torch.no_grad()
    def rollout(self, x0, forcings, steps):
        """forcings: (B, steps+1, lat, lon); returns (B, steps, C, lat, lon)."""
        out, x = [], x0
        for s in range(steps):
            x = self(x, forcings[:, s])
            out.append(x)
        return torch.stack(out, dim=1)


def lat_w(n_lat, device):
    lat = torch.linspace(90, -90, n_lat, device=device)
    w = torch.cos(torch.deg2rad(lat)).clamp(min=0.0)
    return (w / w.mean()).view(-1, 1)


@torch.no_grad()
def evaluate(model, loader, clim, w, device, steps):
    model.eval()
    sums = torch.zeros(3, steps, clim.shape[0], device=device, dtype=torch.float64)
    for x, f in loader:
        x, f = x.to(device), f.to(device)
        pred = model.rollout(x[:, 0], f, steps)
        truth = x[:, 1:]
        mse = (w * (pred - truth) ** 2).mean(dim=(-2, -1))
        pa, ta = pred - clim, truth - clim
        acc = (w * pa * ta).sum((-2, -1)) / torch.sqrt((w * pa ** 2).sum((-2, -1)) * (w * ta ** 2).sum((-2, -1)))
        sums[0] += mse.sum(0).double()
        sums[1] += acc.sum(0).double()
        sums[2] += x.shape[0]
    dist.all_reduce(sums)
    return torch.sqrt(sums[0] / sums[2]), sums[1] / sums[2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-c", "--config", required=True)
    ap.add_argument("--resume", default=None)
    cli = ap.parse_args()
    with open(cli.config) as fh:
        cfg = yaml.safe_load(fh)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s")

    steps_train = cfg.get("train_rollout", 2)
    steps_eval = cfg.get("eval_rollout", 40)
    train_ds = ERA5WithForcings(cfg, cfg["train_start"], cfg["train_end"], steps_train)
    val_ds = ERA5WithForcings(cfg, cfg["val_start"], cfg["val_end"], steps_eval)
    # one initialisation per day (00 UTC), strided over ranks
    val_idx = list(range(0, len(val_ds), 4))[rank::world]
    val_ds = torch.utils.data.Subset(val_ds, val_idx)

    sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.get("seed", 0), drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=sampler,
                          num_workers=cfg.get("workers", 8), pin_memory=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=2, shuffle=False, num_workers=4, pin_memory=True)

    static = torch.as_tensor(np.load(cfg["static"])["fields"], dtype=torch.float32)
    clim = torch.as_tensor(np.load(cfg["clim_norm"])["mean"], dtype=torch.float32, device=device)
    n_prog = len(cfg["prognostic"])
    model = ConvNeXtForecaster(n_prog, static, dim=cfg.get("dim", 256), depth=cfg.get("depth", 16)).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg["epochs"] * len(train_dl), eta_min=1e-7)
    w = lat_w(static.shape[-2], device)
    start = 0

    if cli.resume:
        ck = torch.load(cli.resume, map_location=device)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start = ck["epoch"] + 1

    for epoch in range(start, cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (x, f) in enumerate(train_dl):
            x = x.to(device, non_blocking=True)
            f = f.to(device, non_blocking=True)
            state, loss = x[:, 0], 0.0
            with torch.autocast("cuda", dtype=torch.bfloat16):
                for s in range(steps_train):
                    state = model(state, f[:, s])
                    loss = loss + (w * (state.float() - x[:, s + 1]) ** 2).mean()
            loss = loss / steps_train
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if it % 100 == 0:
                log.info("epoch %d iter %d loss %.5f", epoch, it, loss.item())

        rmse, acc = evaluate(model, val_dl, clim, w, device, steps_eval)
        if rank == 0:
            zi = cfg["prognostic"].index("z500")
            log.info("epoch %d %.0fs | z500 RMSE(d5)=%.4f ACC(d5)=%.3f ACC(d10)=%.3f", epoch, time.time() - t0,
                     rmse[19, zi], acc[19, zi], acc[39, zi])
            os.makedirs(cfg["out_dir"], exist_ok=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch}, os.path.join(cfg["out_dir"], "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
