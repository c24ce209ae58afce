"""Factorised FNO (F-FNO) global forecaster on ERA5 at 1.5 deg.

Two training modes:
  * autoregressive (default): x_t -> x_{t+6h}, long forecasts by iterating the model
  * direct (--direct): x_t, lead -> x_{t+lead}, lead sampled from 6..120 h and injected
    through a learned lead-time embedding (FiLM on every layer)

    torchrun --nnodes=2 --nproc_per_node=4 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 \
        18_ffno_era5.py --data /gpfs/alpine/cli/era5_1p5deg.zarr
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import zarr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


class ERA5Zarr(Dataset):
    def __init__(self, path, split, mean, std, max_lead_steps, direct):
        root = zarr.open(path, mode="r")
        self.x = root["data"]  # (T, C, 121, 240), 6-hourly
        t0, t1 = root.attrs["splits"][split]
        self.t0, self.t1 = t0, t1 - max_lead_steps
        self.mean, self.std = mean[:, None, None], std[:, None, None]
        self.max_lead, self.direct = max_lead_steps, direct

    def __len__(self):
        return self.t1 - self.t0

    def __getitem__(self, i):
        t = self.t0 + i
        lead = np.random.randint(1, self.max_lead + 1) if self.direct else 1
        x = (self.x[t] - self.mean) / self.std
        y = (self.x[t + lead] - self.mean) / self.std
        return torch.from_numpy(x.astype(np.float32)), torch.from_numpy(y.astype(np.float32)), lead


class RolloutWindows(ERA5Zarr):
    """Initial condition plus the normalised truth at every lead 1..max_lead."""

    def __getitem__(self, i):
        t = self.t0 + i
        win = (self.x[t: t + self.max_lead + 1] - self.mean) / self.std
        win = torch.from_numpy(win.astype(np.float32))
        return win[0], win[1:]


class FactorisedSpectralLayer(nn.Module):
    """Separate Fourier mixing along latitude and longitude (F-FNO)."""

    def __init__(self, width, modes_lat, modes_lon):
        super().__init__()
        self.ml, self.mo = modes_lat, modes_lon
        s = 1.0 / width
        self.w_lat = nn.Parameter(s * torch.randn(width, width, modes_lat, dtype=torch.cfloat))
        self.w_lon = nn.Parameter(s * torch.randn(width, width, modes_lon, dtype=torch.cfloat))
        self.ff = nn.Sequential(nn.Conv2d(width, 2 * width, 1), nn.GELU(), nn.Conv2d(2 * width, width, 1))
        self.norm = nn.GroupNorm(1, width)

    def forward(self, x, film=None):
        B, C, H, W = x.shape
        xo = torch.fft.rfft(x, dim=-1, norm="ortho")
        out_o = torch.zeros_like(xo)
        out_o[..., : self.mo] = torch.einsum("bchw,cdw->bdhw", xo[..., : self.mo], self.w_lon)
        xl = torch.fft.rfft(x, dim=-2, norm="ortho")
        out_l = torch.zeros_like(xl)
        out_l[:, :, : self.ml] = torch.einsum("bchw,cdh->bdhw", xl[:, :, : self.ml], self.w_lat)
        h = torch.fft.irfft(out_o, n=W, dim=-1, norm="ortho") + torch.fft.irfft(out_l, n=H, dim=-2, norm="ortho")
        h = self.norm(h)
        if film is not None:
            scale, shift = film.chunk(2, dim=1)
            h = h * (1 + scale[..., None, None]) + shift[..., None, None]
        return x + self.ff(F.gelu(h))


class FFNO(nn.Module):
    def __init__(self, n_ch, width=256, depth=12, modes_lat=48, modes_lon=96, max_lead=20):
        super().__init__()
        self.lift = nn.Conv2d(n_ch + 3, width, 1)
        self.layers = nn.ModuleList([FactorisedSpectralLayer(width, modes_lat, modes_lon) for _ in range(depth)])
        self.lead_embed = nn.Sequential(nn.Embedding(max_lead + 1, width), nn.Linear(width, width), nn.SiLU(),
                                        nn.Linear(width, 2 * width * depth))
        self.proj = nn.Conv2d(width, n_ch, 1)
        self.depth, self.width = depth, width

    def forward(self, x, lead_steps=None):
        B, C, H, W = x.shape
        lat = torch.linspace(-1, 1, H, device=x.device).view(1, 1, H, 1).expand(B, 1, H, W)
        lon = torch.linspace(0, 2 * math.pi, W + 1, device=x.device)[:-1].view(1, 1, 1, W).expand(B, 1, H, W)
        h = self.lift(torch.cat([x, lat, torch.sin(lon), torch.cos(lon)], 1))
        films = [None] * self.depth
        if lead_steps is not None:
            films = self.lead_embed(lead_steps).view(B, self.depth, 2 * self.width).unbind(1)
        for layer, film in zip(self.layers, films):
            h = layer(h, film)
        return x + self.proj(h)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/gpfs/alpine/cli/era5_1p5deg.zarr")
    ap.add_argument("--stats", default="/gpfs/alpine/cli/era5_1p5deg_stats.npz")
    ap.add_argument("--direct", action="store_true")
    ap.add_argument("--max-lead-steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--ckpt-dir", default="/gpfs/alpine/cli/runs/ffno")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(17)

    st = np.load(args.stats)
    mean, std = st["mean"].astype(np.float32), st["std"].astype(np.float32)
    train_ds = ERA5Zarr(args.data, "train", mean, std, args.max_lead_steps, args.direct)
    val_ds = RolloutWindows(args.data, "val", mean, std, args.max_lead_steps, direct=False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    ics = list(range(0, len(val_ds), 8))[rank::world]  # two initial conditions per day
    val_loader = DataLoader(Subset(val_ds, ics), batch_size=1, num_workers=2)

    model = FFNO(len(mean), max_lead=args.max_lead_steps).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader), eta_min=1e-6)

    w = torch.cos(torch.deg2rad(torch.linspace(-90, 90, 121, device=device)))
    w = (w / w.mean()).view(1, 1, -1, 1)
    std_t = torch.as_tensor(std, device=device)
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, y, lead) in enumerate(loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if args.direct:
                pred = model(x, lead.to(device))
            else:
                pred = model(x)
            loss = (w * (pred - y) ** 2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and i % 100 == 0:
                print(f"epoch {epoch} it {i}/{len(loader)} loss {loss.item():.4f}", flush=True)

        # 5-day rollouts (autoregressive) or direct forecasts at each lead
        net = model.module.eval()
        leads = args.max_lead_steps
        sq = torch.zeros(leads, len(mean), device=device)
        n = torch.zeros((), device=device)
        with torch.no_grad():
            for x, truth in val_loader:
                x, truth = x.to(device), truth[0].to(device)
                state = x
                for k in range(leads):
                    if args.direct:
                        pred = net(x, torch.full((1,), k + 1, device=device, dtype=torch.long))
                    else:
                        state = net(state)
                        pred = state
                    sq[k] += (w * (pred[0] - truth[k]) ** 2).mean(dim=(-2, -1)).squeeze(0)
                n += 1
        dist.all_reduce(sq)
        dist.all_reduce(n)
        rmse = torch.sqrt(sq / n) * std_t
        if rank == 0:
            print(f"epoch {epoch}: RMSE ch0 @24h {rmse[3, 0]:.2f} @72h {rmse[11, 0]:.2f} @120h {rmse[-1, 0]:.2f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "rmse": rmse.cpu()},
                       os.path.join(args.ckpt_dir, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
