"""Statistical downscaling of 2 m temperature (1.0 deg -> 0.25 deg) with an EDSR-style CNN.

Inputs: coarse t2m, coarse z500 and the high-resolution orography; target: high-res t2m.
The job script runs one task per GPU:

    #SBATCH --nodes=2 --ntasks-per-node=4 --gpus-per-node=4 --cpus-per-task=10
    export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1)
    export MASTER_PORT=$((20000 + SLURM_JOB_ID % 10000))
    srun python 09_downscaling_edsr_slurm.py --config configs/edsr_t2m.yaml
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
import xarray as xr
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DEFAULTS = dict(
    hr_store="/scratch/shared/downscale/era5_t2m_0p25.zarr",
    lr_store="/scratch/shared/downscale/era5_1p0.zarr",
    orog="/scratch/shared/downscale/orography_0p25.npy",
    stats="/scratch/shared/downscale/stats_1979_2010.npz",
    out_dir="/scratch/shared/downscale/runs/edsr_t2m",
    train_years=(1979, 2010), val_years=(2011, 2014),
    crop=128, scale=4, n_feats=96, n_resblocks=24,
    batch_size=16, lr=2e-4, min_lr=1e-6, epochs=60, warmup_epochs=1, workers=8,
)


def load_config():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default=None)
    args = p.parse_args()
    cfg = dict(DEFAULTS)
    if args.config:
        with open(args.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    return argparse.Namespace(**cfg)


def init_distributed():
    if "SLURM_PROCID" in os.environ:
        rank = int(os.environ["SLURM_PROCID"])
        world_size = int(os.environ["SLURM_NTASKS"])
    else:
        rank = int(os.environ["RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    master = os.environ["MASTER_ADDR"]
    port = os.environ.get("MASTER_PORT", "29500")
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method=f"tcp://{master}:{port}", rank=rank, world_size=world_size)
    return rank, world_size, local_rank


class DownscaleDataset(Dataset):
    def __init__(self, cfg, years, train=True):
        self.cfg, self.train = cfg, train
        sel = slice(f"{years[0]}-01-01", f"{years[1]}-12-31")
        self.hr = xr.open_zarr(cfg.hr_store)["t2m"].sel(time=sel)
        self.lr = xr.open_zarr(cfg.lr_store)[["t2m", "z500"]].sel(time=sel)
        stats = np.load(cfg.stats)
        self.mu, self.sd = stats["mean"].astype(np.float32), stats["std"].astype(np.float32)  # [t2m, z500]
        orog = np.load(cfg.orog).astype(np.float32)
        self.orog = (orog - orog.mean()) / orog.std()

    def __len__(self):
        return self.hr.sizes["time"]

    def __getitem__(self, i):
        s, c = self.cfg.scale, self.cfg.crop
        hr = (self.hr.isel(time=i).values.astype(np.float32) - self.mu[0]) / self.sd[0]
        lr = self.lr.isel(time=i)
        lr = np.stack([(lr["t2m"].values - self.mu[0]) / self.sd[0],
                       (lr["z500"].values - self.mu[1]) / self.sd[1]]).astype(np.float32)
        H, W = hr.shape
        if self.train:
            y0 = np.random.randint(0, (H - c) // s) * s
            x0 = np.random.randint(0, (W - c) // s) * s
        else:
            y0, x0 = ((H - c) // (2 * s)) * s, ((W - c) // (2 * s)) * s
        hr = hr[y0:y0 + c, x0:x0 + c]
        orog = self.orog[y0:y0 + c, x0:x0 + c]
        lr = lr[:, y0 // s:(y0 + c) // s, x0 // s:(x0 + c) // s]
        return torch.from_numpy(lr), torch.from_numpy(orog[None].copy()), torch.from_numpy(hr[None].copy())


class ResBlock(nn.Module):
    def __init__(self, n, res_scale=0.1):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(n, n, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(n, n, 3, padding=1))
        self.res_scale = res_scale

    def forward(self, x):
        return x + self.res_scale * self.body(x)


class EDSR(nn.Module):
    def __init__(self, n_feats, n_blocks, scale):
        super().__init__()
        self.scale = scale
        self.head = nn.Conv2d(2, n_feats, 3, padding=1)
        self.body = nn.Sequential(*[ResBlock(n_feats) for _ in range(n_blocks)], nn.Conv2d(n_feats, n_feats, 3, padding=1))
        up = []
        for _ in range(int(math.log2(scale))):
            up += [nn.Conv2d(n_feats, 4 * n_feats, 3, padding=1), nn.PixelShuffle(2)]
        self.up = nn.Sequential(*up)
        self.fuse = nn.Sequential(nn.Conv2d(n_feats + 1, n_feats, 3, padding=1), nn.ReLU(inplace=True),
                                  nn.Conv2d(n_feats, 1, 3, padding=1))

    def forward(self, lr, orog):
        base = F.interpolate(lr[:, :1], scale_factor=self.scale, mode="bicubic", align_corners=False)
        h = self.head(lr)
        h = self.up(h + self.body(h))
        return base + self.fuse(torch.cat([h, orog], dim=1))


def main():
    cfg = load_config()
    rank, world_size, local_rank = init_distributed()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    train_ds = DownscaleDataset(cfg, cfg.train_years, train=True)
    val_ds = DownscaleDataset(cfg, cfg.val_years, train=False)
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=sampler, num_workers=cfg.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True,
                          worker_init_fn=lambda w: np.random.seed((torch.initial_seed() + 1000 * rank) % 2**32))
    val_sub = torch.utils.data.Subset(val_ds, range(rank, len(val_ds), 4 * world_size))
    val_dl = DataLoader(val_sub, batch_size=32, num_workers=4)

    model = EDSR(cfg.n_feats, cfg.n_resblocks, cfg.scale).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, betas=(0.9, 0.99))
    iters = cfg.epochs * len(train_dl)
    warm = cfg.warmup_epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, total_iters=warm),
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=iters - warm, eta_min=cfg.min_lr)],
        milestones=[warm])

    ckpt_file = os.path.join(cfg.out_dir, "checkpoint.pt")
    start = 0
    if os.path.isfile(ckpt_file):
        ck = torch.load(ckpt_file, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start = ck["epoch"] + 1
    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        print(f"{world_size} ranks, {len(train_ds)} training samples, starting at epoch {start}", flush=True)

    for epoch in range(start, cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        tot = torch.zeros(2, device=device)
        for lr_in, orog, hr in train_dl:
            lr_in, orog, hr = (t.to(device, non_blocking=True) for t in (lr_in, orog, hr))
            loss = F.l1_loss(model(lr_in, orog), hr)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])

        model.eval()
        val = torch.zeros(3, device=device)
        with torch.no_grad():
            for lr_in, orog, hr in val_dl:
                lr_in, orog, hr = (t.to(device) for t in (lr_in, orog, hr))
                pred = model.module(lr_in, orog)
                base = F.interpolate(lr_in[:, :1], scale_factor=cfg.scale, mode="bicubic", align_corners=False)
                val[0] += ((pred - hr) ** 2).mean(dim=(1, 2, 3)).sum()
                val[1] += ((base - hr) ** 2).mean(dim=(1, 2, 3)).sum()
                val[2] += hr.shape[0]
        dist.all_reduce(tot)
        dist.all_reduce(val)
        if rank == 0:
            sd = float(train_ds.sd[0])
            print(f"epoch {epoch:3d} | {time.time() - tic:5.0f}s | L1 {(tot[0] / tot[1]).item():.4f} | "
                  f"val RMSE {sd * (val[0] / val[2]).sqrt().item():.3f} K "
                  f"(bicubic {sd * (val[1] / val[2]).sqrt().item():.3f} K)", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch}, ckpt_file + ".tmp")
            os.replace(ckpt_file + ".tmp", ckpt_file)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
