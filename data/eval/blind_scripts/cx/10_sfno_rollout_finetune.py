"""Spherical Fourier Neural Operator (SFNO) training with multi-step rollout fine-tuning.

Stage 1 trains on single 6 h steps, stage 2 (--rollout 2..4) fine-tunes on
autoregressive rollouts starting from the stage-1 checkpoint.

    torchrun --nnodes=1 --nproc_per_node=8 10_sfno_rollout_finetune.py --rollout 4 \
        --init /shared/wx/sfno/stage1/best.pt --out /shared/wx/sfno/stage2
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch_harmonics as th
import xarray as xr
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

CHANNELS = ["u10m", "v10m", "t2m", "sp", "msl", "tcwv",
            "u250", "v250", "z250", "t250", "u500", "v500", "z500", "t500", "r500",
            "u850", "v850", "z850", "t850", "r850"]


class ERA5Rollout(Dataset):
    def __init__(self, path, years, n_steps, stats_file):
        ds = xr.open_zarr(path)
        ds = ds.sel(time=ds.time.dt.year.isin(list(years)))
        self.x = ds["fields"].sel(channel=CHANNELS)  # (time, channel, lat, lon) at 0.25 deg
        st = np.load(stats_file)
        self.mu = st["mean"][:, None, None].astype(np.float32)
        self.sd = st["std"][:, None, None].astype(np.float32)
        self.n = n_steps

    def __len__(self):
        return self.x.sizes["time"] - self.n

    def __getitem__(self, i):
        w = self.x.isel(time=slice(i, i + self.n + 1)).values.astype(np.float32)
        return torch.from_numpy((w - self.mu) / self.sd)


class SpectralFilter(nn.Module):
    def __init__(self, sht, isht, ch):
        super().__init__()
        self.sht, self.isht = sht, isht
        lmax, mmax = sht.lmax, sht.mmax
        scale = 1.0 / math.sqrt(ch)
        self.weight = nn.Parameter(scale * torch.randn(ch, ch, lmax, 2))
        self.mmax = mmax

    def forward(self, x):
        dtype = x.dtype
        with torch.autocast("cuda", enabled=False):
            c = self.sht(x.float())                           # (B, C, lmax, mmax) complex
            w = torch.view_as_complex(self.weight)
            c = torch.einsum("bilm,iol->bolm", c, w)
            x = self.isht(c)
        return x.to(dtype)


class SFNOBlock(nn.Module):
    def __init__(self, sht, isht, ch, mlp_ratio=2.0):
        super().__init__()
        self.norm0 = nn.InstanceNorm2d(ch, affine=True)
        self.filter = SpectralFilter(sht, isht, ch)
        self.inner_skip = nn.Conv2d(ch, ch, 1)
        self.norm1 = nn.InstanceNorm2d(ch, affine=True)
        hid = int(ch * mlp_ratio)
        self.mlp = nn.Sequential(nn.Conv2d(ch, hid, 1), nn.GELU(), nn.Conv2d(hid, ch, 1))

    def forward(self, x):
        res = x
        x = self.norm0(x)
        x = self.filter(x) + self.inner_skip(x)
        x = nn.functional.gelu(x)
        x = self.norm1(x)
        return res + self.mlp(x)


class SFNO(nn.Module):
    def __init__(self, n_ch, img=(721, 1440), scale=4, embed=384, depth=8):
        super().__init__()
        h, w = img[0] // scale + 1, img[1] // scale
        self.down = th.RealSHT(*img, lmax=h, mmax=w // 2 + 1, grid="equiangular")
        self.up = th.InverseRealSHT(h, w, lmax=h, mmax=w // 2 + 1, grid="equiangular")
        sht = th.RealSHT(h, w, lmax=h, mmax=w // 2 + 1, grid="equiangular")
        isht = th.InverseRealSHT(h, w, lmax=h, mmax=w // 2 + 1, grid="equiangular")
        self.down_final = th.RealSHT(h, w, lmax=h, mmax=w // 2 + 1, grid="equiangular")
        self.up_final = th.InverseRealSHT(*img, lmax=h, mmax=w // 2 + 1, grid="equiangular")
        self.encoder = nn.Sequential(nn.Conv2d(n_ch, embed, 1), nn.GELU(), nn.Conv2d(embed, embed, 1))
        self.blocks = nn.ModuleList([SFNOBlock(sht, isht, embed) for _ in range(depth)])
        self.decoder = nn.Sequential(nn.Conv2d(embed, embed, 1), nn.GELU(), nn.Conv2d(embed, n_ch, 1))

    def forward(self, x):
        res = x
        h = self.encoder(x)
        with torch.autocast("cuda", enabled=False):
            h = self.up(self.down(h.float()))
        for blk in self.blocks:
            h = blk(h)
        with torch.autocast("cuda", enabled=False):
            h = self.up_final(self.down_final(h.float()))
        return res + self.decoder(h)


def quadrature_weights(nlat=721, device=None):
    lat = torch.linspace(90, -90, nlat, device=device)
    w = torch.cos(torch.deg2rad(lat))
    w[0] = w[-1] = w[1] / 4  # pole rows
    return w / w.mean()


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/shared/wx/era5_0p25.zarr")
    ap.add_argument("--stats", default="/shared/wx/era5_0p25_stats_1979_2016.npz")
    ap.add_argument("--init", default=None)
    ap.add_argument("--out", default="/shared/wx/sfno/run")
    ap.add_argument("--rollout", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--wandb_project", default="sfno-era5")
    return ap.parse_args()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project=args.wandb_project, config=vars(args), dir=args.out)

    train = ERA5Rollout(args.data, range(1979, 2017), args.rollout, args.stats)
    valid = ERA5Rollout(args.data, [2018], 20, args.stats)
    valid = Subset(valid, list(range(0, len(valid), 4))[rank::world])
    sampler = DistributedSampler(train, shuffle=True, drop_last=True)
    train_dl = DataLoader(train, batch_size=args.bs, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, persistent_workers=True)
    valid_dl = DataLoader(valid, batch_size=1, num_workers=4)

    model = SFNO(len(CHANNELS)).to(dev)
    if args.init:
        sd = torch.load(args.init, map_location="cpu")["model"]
        model.load_state_dict(sd)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    qw = quadrature_weights(device=dev)[None, None, :, None]

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for win in train_dl:
            win = win.to(dev, non_blocking=True)
            x = win[:, 0]
            loss = 0.0
            with torch.autocast("cuda", dtype=torch.bfloat16):
                for k in range(1, args.rollout + 1):
                    x = model(x)
                    loss = loss + (qw * (x.float() - win[:, k]) ** 2).mean()
            loss = loss / args.rollout
            if not torch.isfinite(loss):
                print(f"[rank {rank}] non-finite loss at step {step}, skipping batch", flush=True)
                opt.zero_grad(set_to_none=True)
                continue
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            opt.step()
            sched.step()
            step += 1
            if rank == 0 and step % 50 == 0:
                wandb.log({"train/loss": loss.item(), "lr": sched.get_last_lr()[0]}, step=step)

        # 5-day rollout RMSE on z500 / t850 in normalised units
        model.eval()
        ci = [CHANNELS.index("z500"), CHANNELS.index("t850")]
        sse = torch.zeros(20, 2, device=dev, dtype=torch.float64)
        cnt = torch.zeros(1, device=dev, dtype=torch.float64)
        with torch.no_grad():
            for win in valid_dl:
                win = win.to(dev)
                x = win[:, 0]
                for k in range(1, 21):
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        x = model.module(x)
                    e = (qw * (x.float()[:, ci] - win[:, k, ci]) ** 2).mean(dim=(-2, -1))
                    sse[k - 1] += e.sum(0).double()
                cnt += win.shape[0]
        dist.all_reduce(sse)
        dist.all_reduce(cnt)
        rmse = torch.sqrt(sse / cnt)
        if rank == 0:
            wandb.log({"val/z500_rmse_d5": rmse[19, 0].item(), "val/t850_rmse_d5": rmse[19, 1].item(),
                       "val/z500_rmse_d1": rmse[3, 0].item(), "epoch": epoch}, step=step)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch,
                        "rollout": args.rollout}, os.path.join(args.out, f"epoch{epoch:02d}.pt"))
            print(f"epoch {epoch}: {time.time() - tic:.0f}s, z500 d5 {rmse[19, 0]:.4f}", flush=True)
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
