#!/usr/bin/env python
# Photometric-free redshift estimation from SDSS DR16 optical spectra with a 1D ResNet.
#
# Spectra were resampled onto a common log-lambda grid (3600-9000 A, 4096 pix) and written
# by plate into shards:  shards/spec_<plate>.h5  with datasets flux (n, 4096), ivar (n, 4096), z (n,)
# Shards have very different sizes (a few hundred to ~1000 spectra).
#
#   torchrun --nproc_per_node=4 12_sdss_spectra_redshift.py --shard_dir /data/sdss_dr16/shards
#
import argparse
import glob
import os
import time

import h5py
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

ZMAX = 4.0
NBINS = 400  # classification over z bins + regression refinement


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shard_dir", required=True)
    ap.add_argument("--val_shards", type=int, default=40, help="last N shards (sorted) for validation")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--bs", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", default="runs/zspec")
    return ap.parse_args()


def load_shards(paths):
    flux, ivar, z = [], [], []
    for p in paths:
        with h5py.File(p, "r") as f:
            flux.append(f["flux"][:].astype(np.float32))
            ivar.append(f["ivar"][:].astype(np.float32))
            z.append(f["z"][:].astype(np.float32))
    flux, ivar, z = np.concatenate(flux), np.concatenate(ivar), np.concatenate(z)
    # normalise each spectrum by its median absolute flux; keep ivar as a second channel
    scale = np.median(np.abs(flux), axis=1, keepdims=True) + 1e-3
    x = np.stack([flux / scale, np.sqrt(ivar) * scale], axis=1)
    x = np.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
    return torch.from_numpy(x), torch.from_numpy(np.clip(z, 0, ZMAX - 1e-3))


class Block1D(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1 = nn.Conv1d(cin, cout, 7, stride, 3, bias=False)
        self.n1 = nn.GroupNorm(8, cout)
        self.c2 = nn.Conv1d(cout, cout, 7, 1, 3, bias=False)
        self.n2 = nn.GroupNorm(8, cout)
        self.sc = nn.Conv1d(cin, cout, 1, stride, bias=False) if (stride > 1 or cin != cout) else nn.Identity()

    def forward(self, x):
        h = F.gelu(self.n1(self.c1(x)))
        return F.gelu(self.n2(self.c2(h)) + self.sc(x))


class ZNet(nn.Module):
    def __init__(self, width=64):
        super().__init__()
        chans = [width, width, 2 * width, 2 * width, 4 * width, 4 * width]
        layers, cin = [], 2
        for c in chans:
            layers.append(Block1D(cin, c, 2))
            cin = c
        self.body = nn.Sequential(*layers)
        self.cls = nn.Linear(cin, NBINS)
        self.reg = nn.Linear(cin, 1)

    def forward(self, x):
        h = self.body(x).mean(-1)
        return self.cls(h), self.reg(h).squeeze(-1)


def z_to_bin(z):
    return (z / ZMAX * NBINS).long().clamp(0, NBINS - 1)


def bin_center(b):
    return (b.float() + 0.5) * ZMAX / NBINS


def scatter_plot(z_true, z_pred, path):
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.scatter(z_true, z_pred, s=1, alpha=0.3)
    ax.plot([0, ZMAX], [0, ZMAX], "k--", lw=0.8)
    ax.set_xlabel("z (pipeline)")
    ax.set_ylabel("z (network)")
    fig.savefig(path, dpi=150, bbox_inches="tight")
    plt.close(fig)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    shards = sorted(glob.glob(os.path.join(args.shard_dir, "spec_*.h5")))
    train_shards, val_shards = shards[:-args.val_shards], shards[-args.val_shards:]
    # each rank only reads its own plates, keeps host memory per process manageable
    my_train = train_shards[rank::world]
    x_tr, z_tr = load_shards(my_train)
    print(f"[rank {rank}] {len(my_train)} shards, {len(z_tr)} spectra", flush=True)
    train_dl = DataLoader(TensorDataset(x_tr, z_tr), batch_size=args.bs, shuffle=True, num_workers=2,
                          pin_memory=True, drop_last=True)

    if rank == 0:
        x_va, z_va = load_shards(val_shards)
        val_dl = DataLoader(TensorDataset(x_va, z_va), batch_size=512, shuffle=False)
        os.makedirs(args.out, exist_ok=True)

    model = DDP(ZNet().to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        stats = torch.zeros(2, device=device)
        for x, z in train_dl:
            x, z = x.to(device, non_blocking=True), z.to(device, non_blocking=True)
            logits, dz = model(x)
            b = z_to_bin(z)
            loss = F.cross_entropy(logits, b) + 10.0 * F.smooth_l1_loss(bin_center(b) + dz * ZMAX / NBINS, z)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            stats += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(stats)

        if rank == 0:
            net = model.module
            net.eval()
            zp, zt = [], []
            with torch.no_grad():
                for x, z in val_dl:
                    logits, dz = net(x.to(device))
                    b = logits.argmax(-1)
                    zp.append((bin_center(b) + dz * ZMAX / NBINS).cpu())
                    zt.append(z)
            zp, zt = torch.cat(zp).numpy(), torch.cat(zt).numpy()
            dz_norm = (zp - zt) / (1 + zt)
            nmad = 1.4826 * np.median(np.abs(dz_norm - np.median(dz_norm)))
            outlier = np.mean(np.abs(dz_norm) > 0.01)
            print(f"epoch {epoch:02d} loss {(stats[0] / stats[1]).item():.4f} sigma_NMAD {nmad:.5f} "
                  f"outliers {outlier * 100:.2f}% ({time.time() - t0:.0f}s)", flush=True)
            scatter_plot(zt, zp, os.path.join(args.out, f"scatter_ep{epoch:02d}.png"))
            torch.save(net.state_dict(), os.path.join(args.out, "znet_last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
