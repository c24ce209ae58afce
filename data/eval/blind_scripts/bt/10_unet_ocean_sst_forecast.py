"""U-Net emulator for daily sea-surface temperature (OISST v2.1, 0.25 deg).

Input: the last 5 daily SST anomaly maps + land mask + day-of-year encoding for a
256x256 regional tile; output: the anomaly 1..7 days ahead. Land pixels are masked
out of the loss. Climatology and std come from 1982-2011 (precomputed).

    torchrun --nnodes=1 --nproc_per_node=8 10_unet_ocean_sst_forecast.py \
        --data /shared/oisst/tiles_256.zarr --out /shared/oisst/runs/unet_7d
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
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def options():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--history", type=int, default=5)
    p.add_argument("--lead", type=int, default=7)
    p.add_argument("--base", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4, help="tiles per GPU")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--amp", action="store_true")
    return p.parse_args()


class SSTTiles(Dataset):
    """zarr group with arrays anom (T, n_tiles, H, W), mask (n_tiles, H, W), doy (T,)."""

    def __init__(self, path, split, history, lead):
        root = zarr.open(path, mode="r")
        self.anom = root["anom"]
        self.mask = np.asarray(root["mask"][:], dtype=np.float32)
        self.doy = np.asarray(root["doy"][:])
        years = np.asarray(root["year"][:])
        sel = {"train": years <= 2015, "val": (years >= 2016) & (years <= 2018)}[split]
        t_ok = np.nonzero(sel)[0]
        t_ok = t_ok[(t_ok >= history - 1) & (t_ok + lead < len(years))]
        n_tiles = self.mask.shape[0]
        self.items = [(t, k) for t in t_ok for k in range(n_tiles)]
        self.history, self.lead = history, lead

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        t, k = self.items[i]
        past = np.asarray(self.anom[t - self.history + 1:t + 1, k], dtype=np.float32)
        future = np.asarray(self.anom[t + 1:t + 1 + self.lead, k], dtype=np.float32)
        mask = self.mask[k]
        ang = 2 * math.pi * self.doy[t] / 365.25
        seas = np.stack([np.full_like(mask, math.sin(ang)), np.full_like(mask, math.cos(ang))])
        x = np.concatenate([np.nan_to_num(past) * mask, mask[None], seas], axis=0)
        return torch.from_numpy(x), torch.from_numpy(np.nan_to_num(future)), torch.from_numpy(mask[None])


def double_conv(cin, cout):
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class UNet(nn.Module):
    def __init__(self, cin, cout, base=64):
        super().__init__()
        chs = [base, base * 2, base * 4, base * 8]
        self.inc = double_conv(cin, chs[0])
        self.downs = nn.ModuleList(double_conv(chs[i], chs[i + 1]) for i in range(3))
        self.mid = double_conv(chs[3], chs[3])
        self.ups = nn.ModuleList(nn.ConvTranspose2d(chs[i + 1] if i < 3 else chs[3], chs[i], 2, stride=2)
                                 for i in reversed(range(4)))
        self.dec = nn.ModuleList(double_conv(2 * chs[i], chs[i]) for i in reversed(range(4)))
        self.outc = nn.Conv2d(chs[0], cout, 1)

    def forward(self, x):
        skips = [self.inc(x)]
        for down in self.downs:
            skips.append(down(F.max_pool2d(skips[-1], 2)))
        h = self.mid(F.max_pool2d(skips[-1], 2))
        for up, dec, skip in zip(self.ups, self.dec, reversed(skips)):
            h = dec(torch.cat([up(h), skip], dim=1))
        return self.outc(h)


def masked_mse(pred, target, mask):
    return ((pred - target) ** 2 * mask).sum() / (mask.sum() * pred.shape[1]).clamp(min=1)


def main():
    args = options()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    train_ds = SSTTiles(args.data, "train", args.history, args.lead)
    val_ds = SSTTiles(args.data, "val", args.history, args.lead)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                          num_workers=args.workers, pin_memory=True, drop_last=True)
    val_part = torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world_size))
    val_dl = DataLoader(val_part, batch_size=16, num_workers=args.workers, pin_memory=True)

    model = UNet(args.history + 3, args.lead, args.base).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(train_dl),
                                                pct_start=0.05, anneal_strategy="cos")
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    os.makedirs(args.out, exist_ok=True)
    last = os.path.join(args.out, "last.ckpt")
    best_path = os.path.join(args.out, "best.ckpt")
    start_epoch, best_rmse = 0, float("inf")
    if os.path.exists(last):
        ck = torch.load(last, map_location=device)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        scaler.load_state_dict(ck["scaler"])
        start_epoch, best_rmse = ck["epoch"] + 1, ck["best_rmse"]

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for x, y, m in train_dl:
            x, y, m = x.to(device, non_blocking=True), y.to(device, non_blocking=True), m.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                pred = model(x)
            loss = masked_mse(pred.float(), y, m)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])

        model.eval()
        se = torch.zeros(args.lead, device=device)
        npts = torch.zeros(1, device=device)
        with torch.no_grad():
            for x, y, m in val_dl:
                x, y, m = x.to(device), y.to(device), m.to(device)
                pred = model.module(x).float()
                se += ((pred - y) ** 2 * m).sum(dim=(0, 2, 3))
                npts += m.sum()
        dist.all_reduce(run)
        dist.all_reduce(se)
        dist.all_reduce(npts)
        rmse = torch.sqrt(se / npts)

        if rank == 0:
            lead_str = " ".join(f"d{k + 1}:{v:.3f}" for k, v in enumerate(rmse.tolist()))
            print(f"[{epoch:03d}] {time.time() - t0:.0f}s train {(run[0] / run[1]).item():.4f} | val RMSE(K) {lead_str}",
                  flush=True)
            state = {"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                     "scheduler": sched.state_dict(), "scaler": scaler.state_dict(),
                     "epoch": epoch, "best_rmse": min(best_rmse, rmse.mean().item())}
            torch.save(state, last)
            if rmse.mean().item() < best_rmse:
                torch.save(state, best_path)
        best_rmse = min(best_rmse, rmse.mean().item())
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
