"""Regional 0.25 deg forecasting over Europe (35N-72N, 25W-45E) with a Swin-style
encoder-decoder; the lateral boundaries are forced with the (coarsened) global
ERA5 state at the target time, as a limited-area model would be.

Hold-out: a random 10 % of the 2000-2019 samples is used for early stopping;
2020-2021 are the test years.
"""
import argparse
import json
import os
import random
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

VARS = ["t2m", "u10", "v10", "msl", "tp", "z500", "t850", "q850", "u850", "v850"]
BOX = dict(latitude=slice(72.0, 35.0 + 0.25), longitude=slice(-25.0, 45.0 - 0.25))  # 148 x 280


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class RegionalPairs(Dataset):
    def __init__(self, zarr, start, end, mean, std, lead=1, halo=8):
        ds = xr.open_zarr(zarr).sel(time=slice(start, end)).sel(**BOX)
        self.a = ds[VARS].to_array("v").transpose("time", "v", "latitude", "longitude")
        self.lat = ds.latitude.values
        self.mu, self.sd = mean[:, None, None], std[:, None, None]
        self.lead, self.halo = lead, halo

    def __len__(self):
        return self.a.sizes["time"] - self.lead

    def __getitem__(self, i):
        x = (self.a.isel(time=i).values - self.mu) / self.sd
        y = (self.a.isel(time=i + self.lead).values - self.mu) / self.sd
        # boundary forcing: target state on an 8-cell frame, zero inside
        bnd = np.zeros_like(y)
        h = self.halo
        bnd[:, :h], bnd[:, -h:], bnd[:, :, :h], bnd[:, :, -h:] = y[:, :h], y[:, -h:], y[:, :, :h], y[:, :, -h:]
        return (torch.from_numpy(np.concatenate([x, bnd]).astype(np.float32)),
                torch.from_numpy(y.astype(np.float32)))


class WindowBlock(nn.Module):
    def __init__(self, dim, heads, win, shift):
        super().__init__()
        self.win, self.shift = win, shift
        self.n1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.n2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        B, H, W, C = x.shape
        s = self.win
        h = self.n1(x)
        if self.shift:
            h = torch.roll(h, (-(s // 2), -(s // 2)), (1, 2))
        h = h.view(B, H // s, s, W // s, s, C).permute(0, 1, 3, 2, 4, 5).reshape(-1, s * s, C)
        h = self.attn(h, h, h, need_weights=False)[0]
        h = h.view(B, H // s, W // s, s, s, C).permute(0, 1, 3, 2, 4, 5).reshape(B, H, W, C)
        if self.shift:
            h = torch.roll(h, (s // 2, s // 2), (1, 2))
        x = x + h
        return x + self.mlp(self.n2(x))


class RegionalSwin(nn.Module):
    def __init__(self, cin, cout, dim=192, depth=8, heads=6, win=7):
        super().__init__()
        self.embed = nn.Conv2d(cin, dim, 4, 4)              # 148x280 -> 37x70 (padded to 42x70)
        self.blocks = nn.ModuleList([WindowBlock(dim, heads, win, shift=i % 2 == 1) for i in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Sequential(nn.ConvTranspose2d(dim, dim // 2, 2, 2), nn.GELU(),
                                nn.ConvTranspose2d(dim // 2, dim // 4, 2, 2), nn.GELU(),
                                nn.Conv2d(dim // 4, cout, 3, padding=1))
        self.cout = cout

    def forward(self, inp):
        x0 = inp[:, : self.cout]
        h = self.embed(inp)
        Hh = h.shape[2]
        h = F.pad(h, (0, 0, 0, (-Hh) % 7)).permute(0, 2, 3, 1)
        for blk in self.blocks:
            h = blk(h)
        h = self.norm(h).permute(0, 3, 1, 2)[:, :, :Hh]
        return x0 + self.up(h)


def weights(lat, device):
    w = np.cos(np.deg2rad(lat))
    return torch.as_tensor(w / w.mean(), dtype=torch.float32, device=device).view(1, 1, -1, 1)


def evaluate(net, loader, w, device):
    net.eval()
    s = torch.zeros(len(VARS) + 1, device=device, dtype=torch.float64)
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                p = net(x).float()
            s[:-1] += (w * (p - y) ** 2).mean(dim=(-2, -1)).sum(0).double()
            s[-1] += x.shape[0]
    dist.all_reduce(s)
    return torch.sqrt(s[:-1] / s[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--zarr", default="/data/shared/era5/europe_0p25_1h.zarr")
    ap.add_argument("--stats", default="/data/shared/era5/europe_0p25_stats_2000_2019.json")
    ap.add_argument("--out", default="/data/shared/runs/regional_swin")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--lead", type=int, default=6, help="hours")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--patience", type=int, default=6)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    seed_everything(args.seed + rank)

    with open(args.stats) as f:
        st = json.load(f)
    mean = np.array([st[v]["mean"] for v in VARS], dtype=np.float32)
    std = np.array([st[v]["std"] for v in VARS], dtype=np.float32)

    full = RegionalPairs(args.zarr, "2000-01-01", "2019-12-31", mean, std, lead=args.lead)
    perm = np.random.permutation(len(full))
    n_val = len(full) // 10
    train_ds = Subset(full, perm[n_val:].tolist())
    val_ds = Subset(full, sorted(perm[:n_val].tolist())[rank::world])
    test_ds = RegionalPairs(args.zarr, "2020-01-01", "2021-12-31", mean, std, lead=args.lead)
    test_ds = Subset(test_ds, list(range(rank, len(test_ds), 6 * world)))

    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=8, pin_memory=True,
                          persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=16, num_workers=4)
    test_dl = DataLoader(test_ds, batch_size=16, num_workers=4)

    net = RegionalSwin(2 * len(VARS), len(VARS)).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(train_dl))
    w = weights(full.lat, device)

    best, bad = float("inf"), 0
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                p = model(x)
            loss = (w * (p.float() - y) ** 2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and it % 200 == 0:
                print(f"epoch {epoch} it {it} loss {loss.item():.4f}", flush=True)

        val = evaluate(net, val_dl, w, device).mean().item()
        if val < best:
            best, bad = val, 0
            if rank == 0:
                torch.save({"model": net.state_dict(), "epoch": epoch, "val": val}, os.path.join(args.out, "best.pt"))
        else:
            bad += 1
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s) val {val:.4f} best {best:.4f}", flush=True)
        if bad >= args.patience:
            break

    dist.barrier()
    net.load_state_dict(torch.load(os.path.join(args.out, "best.pt"), map_location=device)["model"])
    test_rmse = evaluate(net, test_dl, w, device) * torch.as_tensor(std, device=device)
    if rank == 0:
        print("test RMSE:", {v: round(r, 3) for v, r in zip(VARS, test_rmse.tolist())}, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
