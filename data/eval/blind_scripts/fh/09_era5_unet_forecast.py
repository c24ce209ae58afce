#!/usr/bin/env python
"""6-hour ERA5 forecasting with a residual U-Net (0.25 deg, 69 channels).

sbatch script (jobs/era5_unet.sh):

    #SBATCH --nodes=4 --ntasks-per-node=4 --gres=gpu:4 --cpus-per-task=12
    #SBATCH --time=24:00:00 --requeue --signal=USR1@300
    module load cuda/12.1 nccl
    export MASTER_ADDR=$(scontrol show hostnames $SLURM_NODELIST | head -n1)
    export MASTER_PORT=29533
    srun python era5_unet.py --src $WORK/era5/npy_2000_2017 --results $WORK/era5/runs

Yearly .npy stacks are copied to the node-local SSD ($TMPDIR) at startup.
"""
import argparse
import datetime
import glob
import os
import shutil
import signal
import subprocess
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

SIGNALLED = False


def on_signal(sig, frame):
    global SIGNALLED
    SIGNALLED = True


class ERA5Pairs(Dataset):
    def __init__(self, files, mean, std, lead=1):
        self.arrays = [np.load(f, mmap_mode="r") for f in files]
        self.lengths = [a.shape[0] - lead for a in self.arrays]
        self.cum = np.cumsum([0] + self.lengths)
        self.mean = mean[:, None, None].astype(np.float32)
        self.std = std[:, None, None].astype(np.float32)
        self.lead = lead

    def __len__(self):
        return int(self.cum[-1])

    def __getitem__(self, idx):
        k = int(np.searchsorted(self.cum, idx, side="right") - 1)
        t = idx - self.cum[k]
        x = (np.asarray(self.arrays[k][t], dtype=np.float32) - self.mean) / self.std
        y = (np.asarray(self.arrays[k][t + self.lead], dtype=np.float32) - self.mean) / self.std
        return torch.from_numpy(x), torch.from_numpy(y)


class Block(nn.Module):
    def __init__(self, c_in, c_out):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, padding_mode="circular"),
                                 nn.GroupNorm(8, c_out), nn.GELU(),
                                 nn.Conv2d(c_out, c_out, 3, padding=1, padding_mode="circular"),
                                 nn.GroupNorm(8, c_out), nn.GELU())

    def forward(self, x):
        return self.net(x)


class UNet(nn.Module):
    def __init__(self, channels=69, width=128):
        super().__init__()
        w = [width, width * 2, width * 4, width * 8]
        self.enc = nn.ModuleList([Block(channels, w[0]), Block(w[0], w[1]),
                                  Block(w[1], w[2]), Block(w[2], w[3])])
        self.up = nn.ModuleList([nn.ConvTranspose2d(w[i + 1], w[i], 2, stride=2) for i in range(3)])
        self.dec = nn.ModuleList([Block(w[i] * 2, w[i]) for i in range(3)])
        self.out = nn.Conv2d(w[0], channels, 1)

    def forward(self, x):
        h, skips = x, []
        for i, blk in enumerate(self.enc):
            h = blk(h)
            if i < 3:
                skips.append(h)
                h = F.max_pool2d(h, 2)
        for i in reversed(range(3)):
            h = self.up[i](h)
            h = self.dec[i](torch.cat([h, skips[i]], 1))
        return x + self.out(h)


def stage(src, dst, local_rank):
    marker = os.path.join(dst, ".complete")
    if local_rank == 0 and not os.path.exists(marker):
        os.makedirs(dst, exist_ok=True)
        for f in sorted(glob.glob(os.path.join(src, "*.npy"))):
            shutil.copy(f, dst)
        shutil.copy(os.path.join(src, "stats.npz"), dst)
        open(marker, "w").close()
    dist.barrier()
    return dst


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", required=True)
    ap.add_argument("--results", required=True)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=5e-4)
    args = ap.parse_args()

    rank = int(os.environ["SLURM_PROCID"])
    world = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=rank, world_size=world,
                            timeout=datetime.timedelta(hours=1))
    signal.signal(signal.SIGUSR1, on_signal)

    local = stage(args.src, os.path.join(os.environ.get("TMPDIR", "/tmp"), "era5"), local_rank)
    run_dir = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"era5_unet_{os.environ['SLURM_JOB_ID']}")
    os.makedirs(run_dir, exist_ok=True)
    ckpt_path = os.path.join(run_dir, "checkpoint.pt")

    stats = np.load(os.path.join(local, "stats.npz"))
    files = sorted(glob.glob(os.path.join(local, "*.npy")))
    train_files = [f for f in files if int(os.path.basename(f)[:4]) <= 2015]
    val_files = [f for f in files if int(os.path.basename(f)[:4]) > 2015]
    train_ds = ERA5Pairs(train_files, stats["mean"], stats["std"])
    val_ds = ERA5Pairs(val_files, stats["mean"], stats["std"])

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    nw = int(os.environ.get("SLURM_CPUS_PER_TASK", "8"))
    train_dl = DataLoader(train_ds, args.bs, sampler=sampler, num_workers=nw, pin_memory=True,
                          drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, args.bs, sampler=val_sampler, num_workers=nw)

    model = DDP(UNet().cuda(), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_dl))
    lat = torch.deg2rad(torch.linspace(90, -90, 721)).cos().cuda()
    w_lat = (lat / lat.mean()).view(1, 1, -1, 1)

    start = 0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start = ck["epoch"] + 1

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        interrupted = False
        for step, (x, y) in enumerate(train_dl):
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            x = F.pad(x, (0, 0, 0, 7), mode="replicate")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(x)[..., :721, :]
            loss = (w_lat * (pred.float() - y) ** 2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if step % 100 == 0:
                flag = torch.tensor(float(SIGNALLED), device="cuda")
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                if flag.item() > 0:
                    interrupted = True
                    break
                if rank == 0:
                    print(f"ep {epoch} step {step} wmse {loss.item():.4f}", flush=True)

        if interrupted:
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                            "sched": sched.state_dict(), "epoch": epoch - 1}, ckpt_path)
                subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]])
            dist.barrier()
            break

        model.eval()
        err = torch.zeros(2, device="cuda")
        with torch.no_grad():
            for x, y in val_dl:
                x, y = x.cuda(), y.cuda()
                pred = model.module(F.pad(x, (0, 0, 0, 7), mode="replicate"))[..., :721, :]
                err[0] += (w_lat * (pred - y) ** 2).mean(dim=(2, 3)).sum()
                err[1] += x.shape[0] * x.shape[1]
        dist.all_reduce(err)
        if rank == 0:
            rmse = (err[0] / err[1]).sqrt().item()
            print(f"epoch {epoch} val wRMSE (normalised) {rmse:.4f} [{time.time() - t0:.0f}s]",
                  flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch}, ckpt_path)
        dist.barrier()
    else:
        if rank == 0:
            dest = os.path.join(args.results, os.path.basename(run_dir))
            shutil.copytree(run_dir, dest, dirs_exist_ok=True)
            print(f"results copied to {dest}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
