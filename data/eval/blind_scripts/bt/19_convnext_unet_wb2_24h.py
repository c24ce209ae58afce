"""ConvNeXt U-Net emulator on WeatherBench2 ERA5 (1.5 deg, 121x240), 24 h time step.

Predicts the 24 h increment of 13 variables (5 upper-air at 500/850 hPa + surface) from
the current state, TOA incident solar radiation and static fields. Validation: 2019,
0/12 UTC initialisations, lat-weighted RMSE in physical units per variable.

    torchrun --nnodes=1 --nproc_per_node=8 19_convnext_unet_wb2_24h.py \
        --zarr /datasets/wb2/era5_1p5deg_6h.zarr --stats /datasets/wb2/stats_1979_2017.nc \
        --out /shared/runs/cnx_unet_24h
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import xarray as xr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

UPPER = [("geopotential", 500), ("geopotential", 850), ("temperature", 500), ("temperature", 850),
         ("u_component_of_wind", 500), ("u_component_of_wind", 850), ("v_component_of_wind", 500),
         ("v_component_of_wind", 850), ("specific_humidity", 700)]
SURFACE = ["2m_temperature", "mean_sea_level_pressure", "10m_u_component_of_wind", "10m_v_component_of_wind"]
NAMES = [f"{v}_{l}" for v, l in UPPER] + SURFACE


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--zarr", required=True)
    p.add_argument("--stats", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--dims", type=int, nargs=4, default=[96, 192, 384, 768])
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=4e-4)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


class WB2Pairs(Dataset):
    def __init__(self, store, stats_path, years, stride=1):
        ds = xr.open_zarr(store, consolidated=True)
        self.ds = ds.sel(time=slice(f"{years[0]}-01-01", f"{years[1]}-12-31T18"))
        st = xr.open_dataset(stats_path)
        self.mu = np.array([st[f"{n}_mean"].item() for n in NAMES], np.float32)[:, None, None]
        self.sd = np.array([st[f"{n}_std"].item() for n in NAMES], np.float32)[:, None, None]
        self.dsd = np.array([st[f"{n}_diff24h_std"].item() for n in NAMES], np.float32)[:, None, None]
        static = np.stack([ds["land_sea_mask"].values, ds["geopotential_at_surface"].values / 9.81 / 1000.0])
        self.static = static.astype(np.float32)
        self.starts = np.arange(0, self.ds.sizes["time"] - 4, stride)

    def __len__(self):
        return len(self.starts)

    def _state(self, t):
        snap = self.ds.isel(time=t)
        up = [snap[v].sel(level=l).values for v, l in UPPER]
        sf = [snap[v].values for v in SURFACE]
        return np.stack(up + sf).astype(np.float32), snap["toa_incident_solar_radiation"].values.astype(np.float32)

    def __getitem__(self, i):
        t = self.starts[i]
        x, toa = self._state(t)
        y, _ = self._state(t + 4)  # 4 x 6 h
        xn = (x - self.mu) / self.sd
        target = (y - x) / self.dsd
        inp = np.concatenate([xn, toa[None] / 1e6, self.static])
        return torch.from_numpy(inp), torch.from_numpy(target), torch.from_numpy(x)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim, padding_mode="circular")
        self.norm = nn.LayerNorm(dim)
        self.pw1, self.pw2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(1e-6 * torch.ones(dim))

    def forward(self, x):
        h = self.dw(x).permute(0, 2, 3, 1)
        h = self.pw2(F.gelu(self.pw1(self.norm(h))))
        return x + (self.gamma * h).permute(0, 3, 1, 2)


class ConvNeXtUNet(nn.Module):
    def __init__(self, cin, cout, dims):
        super().__init__()
        self.stem = nn.Conv2d(cin, dims[0], 3, padding=1)
        self.enc = nn.ModuleList(nn.Sequential(ConvNeXtBlock(d), ConvNeXtBlock(d)) for d in dims)
        self.down = nn.ModuleList(nn.Conv2d(dims[i], dims[i + 1], 2, stride=2) for i in range(3))
        self.up = nn.ModuleList(nn.ConvTranspose2d(dims[i + 1], dims[i], 2, stride=2) for i in range(3))
        self.dec = nn.ModuleList(nn.Sequential(nn.Conv2d(2 * dims[i], dims[i], 1), ConvNeXtBlock(dims[i]))
                                 for i in range(3))
        self.head = nn.Conv2d(dims[0], cout, 1)

    def forward(self, x):
        H, W = x.shape[-2:]
        x = F.pad(x, (0, 0, 0, 128 - H), mode="replicate")  # 121 -> 128 rows
        h = self.stem(x)
        skips = []
        for i in range(4):
            h = self.enc[i](h)
            if i < 3:
                skips.append(h)
                h = self.down[i](h)
        for i in reversed(range(3)):
            h = self.dec[i](torch.cat([self.up[i](h), skips[i]], dim=1))
        return self.head(h)[..., :H, :W]


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_ds = WB2Pairs(args.zarr, args.stats, (1979, 2017))
    val_ds = WB2Pairs(args.zarr, args.stats, (2019, 2019), stride=2)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True, prefetch_factor=4)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=4, num_workers=4)

    n_vars = len(NAMES)
    model = ConvNeXtUNet(n_vars + 3, n_vars, args.dims).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    total_steps = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total_steps, pct_start=0.03)

    lat = np.linspace(-90, 90, 121)
    w = np.cos(np.deg2rad(lat))
    w_lat = torch.tensor(w / w.mean(), dtype=torch.float32, device=device).view(1, 1, -1, 1)
    dsd = torch.from_numpy(train_ds.dsd).to(device)

    os.makedirs(args.out, exist_ok=True)
    ckpt_path = os.path.join(args.out, "checkpoint.pt")
    start_epoch = 0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch = ck["epoch"] + 1

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (inp, target, _) in enumerate(train_loader):
            inp, target = inp.to(device, non_blocking=True), target.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(inp)
            loss = (w_lat * (out.float() - target) ** 2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if step % 200 == 0:
                logged = loss.detach().clone()
                dist.all_reduce(logged, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {step}/{len(train_loader)} loss {logged.item():.4f}", flush=True)

        model.eval()
        sum_sq = np.zeros(n_vars)
        count = 0
        with torch.no_grad():
            for inp, target, x_phys in val_loader:
                inp, target, x_phys = inp.to(device), target.to(device), x_phys.to(device)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out = model.module(inp).float()
                err = (out - target) * dsd  # increment error == state error, physical units
                sum_sq += (w_lat * err ** 2).mean(dim=(-1, -2)).sum(0).cpu().numpy()
                count += inp.shape[0]
        stats = torch.from_numpy(np.append(sum_sq, count))
        dist.all_reduce(stats)
        rmse = np.sqrt(stats[:-1].numpy() / stats[-1].item())

        if rank == 0:
            show = {k: rmse[NAMES.index(k)] for k in ["geopotential_500", "temperature_850", "2m_temperature"]}
            print(f"epoch {epoch} done ({time.time() - t0:.0f}s) val RMSE 24h: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in show.items()), flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "val_rmse": dict(zip(NAMES, rmse.tolist()))}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
