"""Lat-lon U-Net forecaster on WeatherBench2 (1.5deg, 121x240), 12h step, 2-step rollout loss.

    torchrun --nproc_per_node=4 14_unet_wb2_forecast.py --run-name unet_wb2_v3
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
import xarray as xr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

LEVEL_VARS = [("geopotential", 500), ("temperature", 850), ("specific_humidity", 700),
              ("u_component_of_wind", 850), ("v_component_of_wind", 850)]
SURF_VARS = ["2m_temperature", "mean_sea_level_pressure", "10m_u_component_of_wind", "10m_v_component_of_wind"]


def get_config():
    p = argparse.ArgumentParser()
    p.add_argument("--zarr", default="gs-mirror/wb2/era5_1.5deg_6h.zarr")
    p.add_argument("--train-years", default="1979-2016")
    p.add_argument("--val-years", default="2018-2018")
    p.add_argument("--step-hours", type=int, default=12)
    p.add_argument("--rollout", type=int, default=2)
    p.add_argument("--base", type=int, default=96)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--run-name", default="unet_wb2")
    p.add_argument("--out", default="checkpoints")
    p.add_argument("--wandb-project", default="wb2-forecast")
    return p.parse_args()


class WB2(Dataset):
    def __init__(self, path, years, step, rollout):
        y0, y1 = map(int, years.split("-"))
        ds = xr.open_zarr(path).sel(time=slice(f"{y0}-01-01", f"{y1}-12-31"))
        arrs = [ds[v].sel(level=l) for v, l in LEVEL_VARS] + [ds[v] for v in SURF_VARS]
        self.da = xr.concat(arrs, dim="channel").transpose("time", "channel", "latitude", "longitude")
        clim = xr.open_zarr(path.replace(".zarr", "_stats.zarr"))
        self.mean = clim["mean"].values.reshape(-1, 1, 1).astype(np.float32)
        self.std = clim["std"].values.reshape(-1, 1, 1).astype(np.float32)
        self.stride = step // 6
        self.rollout = rollout

    def __len__(self):
        return self.da.sizes["time"] - self.stride * self.rollout

    def __getitem__(self, i):
        idx = [i + k * self.stride for k in range(self.rollout + 1)]
        x = self.da.isel(time=idx).values.astype(np.float32)
        return torch.from_numpy((x - self.mean) / self.std)


def conv_block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(8, cout), nn.SiLU(),
                         nn.Conv2d(cout, cout, 3, padding=1), nn.GroupNorm(8, cout), nn.SiLU())


class UNet(nn.Module):
    def __init__(self, c, base=96):
        super().__init__()
        self.d1, self.d2, self.d3 = conv_block(c, base), conv_block(base, 2 * base), conv_block(2 * base, 4 * base)
        self.mid = conv_block(4 * base, 4 * base)
        self.u3, self.u2 = conv_block(8 * base, 2 * base), conv_block(4 * base, base)
        self.u1 = conv_block(2 * base, base)
        self.out = nn.Conv2d(base, c, 1)

    def forward(self, x):
        H, W = x.shape[-2:]
        x_in = x
        x = F.pad(x, (0, 256 - W, 0, 128 - H), mode="replicate")
        h1 = self.d1(x)
        h2 = self.d2(F.avg_pool2d(h1, 2))
        h3 = self.d3(F.avg_pool2d(h2, 2))
        m = self.mid(F.avg_pool2d(h3, 2))
        y = self.u3(torch.cat([F.interpolate(m, scale_factor=2), h3], 1))
        y = self.u2(torch.cat([F.interpolate(y, scale_factor=2), h2], 1))
        y = self.u1(torch.cat([F.interpolate(y, scale_factor=2), h1], 1))
        return x_in + self.out(y)[..., :H, :W]


def lat_weights(n_lat, device):
    lat = torch.linspace(-90, 90, n_lat, device=device)
    w = torch.cos(torch.deg2rad(lat)).clamp(min=1e-3)
    return (w / w.mean()).view(1, 1, n_lat, 1)


@torch.no_grad()
def evaluate(net, loader, w, std, device, n_ch):
    net.eval()
    sse = torch.zeros(n_ch, device=device, dtype=torch.float64)
    n = torch.zeros((), device=device, dtype=torch.float64)
    for seq in loader:
        seq = seq.to(device, non_blocking=True)
        x = seq[:, 0]
        for k in range(1, seq.shape[1]):
            x = net(x)
        err = (x - seq[:, -1]) * std
        sse += (err ** 2 * w).mean(dim=(-1, -2)).sum(0).double()
        n += seq.shape[0]
    dist.all_reduce(sse)
    dist.all_reduce(n)
    net.train()
    return torch.sqrt(sse / n)


def main():
    cfg = get_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    run_id = f"{cfg.run_name}-{os.environ.get('SLURM_JOB_ID', 'local')}"
    wandb.init(project=cfg.wandb_project, name=cfg.run_name, id=run_id, resume="allow", config=vars(cfg))

    train_ds = WB2(cfg.zarr, cfg.train_years, cfg.step_hours, cfg.rollout)
    val_ds = WB2(cfg.zarr, cfg.val_years, cfg.step_hours, 10)  # 5-day lead
    val_ds = Subset(val_ds, list(range(0, len(val_ds), 8))[rank::world])
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=sampler, num_workers=8,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=4, num_workers=4, pin_memory=True)

    n_ch = len(LEVEL_VARS) + len(SURF_VARS)
    net = UNet(n_ch, cfg.base).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.epochs * len(train_dl), eta_min=1e-6)
    w = lat_weights(121, device)
    std = torch.from_numpy(train_ds.std).to(device).unsqueeze(0)
    names = [f"{v[:1]}{l}" for v, l in LEVEL_VARS] + ["t2m", "msl", "u10", "v10"]

    ck_dir = os.path.join(cfg.out, cfg.run_name)
    ck_path = os.path.join(ck_dir, "last.pt")
    start = 0
    if os.path.exists(ck_path):
        ck = torch.load(ck_path, map_location="cpu")
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start = ck["epoch"] + 1

    step = start * len(train_dl)
    for epoch in range(start, cfg.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for seq in train_dl:
            seq = seq.to(device, non_blocking=True)
            x, loss = seq[:, 0], 0.0
            with torch.autocast("cuda", dtype=torch.bfloat16):
                for k in range(1, seq.shape[1]):
                    x = model(x)
                    loss = loss + ((x.float() - seq[:, k]) ** 2 * w).mean()
            loss = loss / cfg.rollout
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if rank == 0 and step % 50 == 0:
                wandb.log({"train/loss": loss.item(), "train/grad_norm": gnorm.item(),
                           "lr": sched.get_last_lr()[0]}, step=step)

        rmse = evaluate(net, val_dl, w, std, device, n_ch)
        if rank == 0:
            wandb.log({f"val/rmse_120h/{nm}": r for nm, r in zip(names, rmse.tolist())}, step=step)
            print(f"epoch {epoch} {time.time() - t0:.0f}s z500@120h {rmse[0]:.1f} t850@120h {rmse[1]:.2f}", flush=True)
            os.makedirs(ck_dir, exist_ok=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, ck_path)
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
