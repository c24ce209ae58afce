"""Canopy height regression from Sentinel-2 (10 bands) + Sentinel-1 (2 bands) with sparse GEDI RH98 labels.

Patches are 128x128 at 10 m; only the pixels that hold a GEDI footprint carry a label
(the rest are NaN), typically 0-40 footprints per patch.

    torchrun --nproc_per_node=8 01_canopy_height_gedi.py --shards /data/chm/shards --epochs 30
"""
import argparse
import glob
import math
import os
import time

import numpy as np
import segmentation_models_pytorch as smp
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

S2_MEAN = np.array([560, 810, 780, 1190, 2150, 2520, 2670, 2780, 2190, 1410], np.float32)
S2_STD = np.array([390, 420, 520, 540, 700, 830, 890, 900, 840, 740], np.float32)
S1_MEAN = np.array([-12.5, -19.3], np.float32)
S1_STD = np.array([4.2, 4.8], np.float32)
MEAN = np.concatenate([S2_MEAN, S1_MEAN])[:, None, None]
STD = np.concatenate([S2_STD, S1_STD])[:, None, None]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--shards", default="/data/chm/shards")
    p.add_argument("--logdir", default="/data/chm/runs/unet_r50_s1s2")
    p.add_argument("--bs", type=int, default=32)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--max-height", type=float, default=60.0)
    return p.parse_args()


class PatchShards(Dataset):
    """All .npz shards are memory-mapped; each holds x (N, 12, 128, 128) int16 and y (N, 128, 128) float16."""

    def __init__(self, files, augment):
        self.files = files
        self.offsets = [0]
        for f in files:
            with np.load(f, mmap_mode="r") as z:
                self.offsets.append(self.offsets[-1] + z["y"].shape[0])
        self.augment = augment

    def __len__(self):
        return self.offsets[-1]

    def __getitem__(self, i):
        s = np.searchsorted(self.offsets, i, side="right") - 1
        with np.load(self.files[s]) as z:
            x = z["x"][i - self.offsets[s]].astype(np.float32)
            y = z["y"][i - self.offsets[s]].astype(np.float32)
        x[10:] = x[10:] / 100.0  # S2 is reflectance * 1e4, S1 stored as dB * 100
        x = (x - MEAN) / STD
        if self.augment:
            k = np.random.randint(4)
            x, y = np.rot90(x, k, (1, 2)), np.rot90(y, k)
            if np.random.rand() < 0.5:
                x, y = x[:, :, ::-1], y[:, ::-1]
        return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(y))


def masked_losses(pred, target, max_h):
    valid = torch.isfinite(target)
    p, t = pred[valid], target[valid].clamp(0, max_h)
    return nn.functional.smooth_l1_loss(p, t, beta=2.0), valid.sum()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    files = sorted(glob.glob(os.path.join(args.shards, "*.npz")))
    val_files = [f for f in files if os.path.basename(f).startswith("val_")]
    train_files = [f for f in files if os.path.basename(f).startswith("train_")]
    train_ds = PatchShards(train_files, augment=True)
    val_ds = PatchShards(val_files, augment=False)
    val_idx = list(range(rank, len(val_ds), world))

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, val_idx), batch_size=64, num_workers=4)

    model = smp.Unet("resnet50", encoder_weights=None, in_channels=12, classes=1, activation=None)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    total = args.epochs * len(train_dl)
    warm = 500
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * s / total)))

    writer = SummaryWriter(args.logdir) if rank == 0 else None
    best_mae, gstep = float("inf"), 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if not torch.isfinite(y).any():
                continue  # no GEDI footprint in the whole batch
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(x).squeeze(1).float()
            loss, n = masked_losses(pred, y, args.max_height)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            gstep += 1
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
            if writer is not None and gstep % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), gstep)
                writer.add_scalar("train/lr", sched.get_last_lr()[0], gstep)
        dist.all_reduce(acc)

        model.eval()
        err = torch.zeros(3, device=device, dtype=torch.float64)  # abs err, sq err, count
        with torch.no_grad():
            for x, y in val_dl:
                x, y = x.to(device), y.to(device)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    pred = model.module(x).squeeze(1).float()
                v = torch.isfinite(y)
                d = pred[v] - y[v]
                err += torch.stack([d.abs().sum(), (d ** 2).sum(), v.sum()]).double()
        dist.all_reduce(err)
        mae = (err[0] / err[2]).item()
        rmse = math.sqrt((err[1] / err[2]).item())

        if rank == 0:
            print(f"epoch {epoch} loss {(acc[0] / acc[1].clamp(min=1)).item():.3f} val MAE {mae:.2f} m RMSE {rmse:.2f} m "
                  f"({time.time() - t0:.0f}s)", flush=True)
            writer.add_scalar("val/mae", mae, epoch)
            writer.add_scalar("val/rmse", rmse, epoch)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "mae": mae},
                       os.path.join(args.logdir, "last.pt"))
            if mae < best_mae:
                best_mae = mae
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "mae": mae},
                           os.path.join(args.logdir, "best.pt"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
