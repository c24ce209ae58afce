#!/usr/bin/env python3
"""Spiking CNN on N-CARS with voxel-grid inputs (one time step per temporal bin).

Events of each 100 ms sample are binned into a polarity-split voxel grid of
shape (B, 2, H, W); the SNN consumes one bin per time step and is trained with
an arctan surrogate gradient through time.

    torchrun --nproc_per_node=4 01_ncars_voxel_snn.py --data /data/ncars --cache /data/cache/ncars
"""
import argparse
import glob
import logging
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

SENSOR_W, SENSOR_H = 120, 100

log = logging.getLogger("ncars")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--cache", required=True, help="where voxel grids are cached")
    p.add_argument("--out", default="runs/ncars_snn")
    p.add_argument("--bins", type=int, default=10)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--tau", type=float, default=2.0)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


# --------------------------------------------------------------------------- data
def load_events(path):
    # pre-extracted from the .dat files: structured array with x, y, t (us), p
    ev = np.load(path)
    return ev["x"].astype(np.int64), ev["y"].astype(np.int64), ev["t"].astype(np.float64), ev["p"].astype(np.int64)


def events_to_voxel(x, y, t, p, bins, H=SENSOR_H, W=SENSOR_W):
    vox = np.zeros((bins, 2, H, W), dtype=np.float32)
    if len(t) == 0:
        return vox
    t = (t - t[0]) / max(t[-1] - t[0], 1.0) * (bins - 1)
    t0 = np.floor(t).astype(np.int64)
    frac = (t - t0).astype(np.float32)
    for off, w in ((0, 1.0 - frac), (1, frac)):
        tb = t0 + off
        ok = (tb < bins) & (x < W) & (y < H)
        np.add.at(vox, (tb[ok], p[ok], y[ok], x[ok]), w[ok])
    return vox


class NCarsVoxels(Dataset):
    def __init__(self, root, split, bins, cache_dir, augment=False):
        self.augment = augment
        cache_file = os.path.join(cache_dir, f"{split}_bins{bins}.npz")
        if os.path.isfile(cache_file):
            blob = np.load(cache_file)
            self.voxels, self.labels = blob["voxels"], blob["labels"]
        else:
            files, labels = [], []
            for label, cls in enumerate(("background", "cars")):
                fs = sorted(glob.glob(os.path.join(root, split, cls, "*.npy")))
                files += fs
                labels += [label] * len(fs)
            self.voxels = np.stack([events_to_voxel(*load_events(f), bins) for f in files])
            self.labels = np.asarray(labels, dtype=np.int64)
            os.makedirs(cache_dir, exist_ok=True)
            np.savez(cache_file, voxels=self.voxels, labels=self.labels)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        v = torch.from_numpy(self.voxels[i])
        if self.augment and torch.rand(1).item() < 0.5:
            v = torch.flip(v, dims=[-1])
        # log-scale event counts, keeps the dynamic range in check
        v = torch.log1p(v)
        return v, int(self.labels[i])


# -------------------------------------------------------------------------- model
class ATanSpike(torch.autograd.Function):
    alpha = 2.0

    @staticmethod
    def forward(ctx, v):
        ctx.save_for_backward(v)
        return (v >= 0).to(v.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        (v,) = ctx.saved_tensors
        a = ATanSpike.alpha
        sg = a / 2 / (1 + (math.pi / 2 * a * v).pow(2))
        return grad_out * sg


class LIF(nn.Module):
    """Leaky integrate-and-fire with hard reset; processes a (T, N, ...) tensor."""

    def __init__(self, tau=2.0, v_th=1.0):
        super().__init__()
        self.decay = 1.0 - 1.0 / tau
        self.v_th = v_th

    def forward(self, x_seq):
        v = torch.zeros_like(x_seq[0])
        out = []
        for x in x_seq:
            v = self.decay * v + x
            s = ATanSpike.apply(v - self.v_th)
            v = v * (1.0 - s)
            out.append(s)
        return torch.stack(out)


class TimeDistributed(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x):
        T, N = x.shape[:2]
        y = self.m(x.flatten(0, 1))
        return y.view(T, N, *y.shape[1:])


def conv_block(cin, cout, tau):
    return nn.Sequential(
        TimeDistributed(nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout))),
        LIF(tau),
        TimeDistributed(nn.MaxPool2d(2)),
    )


class SpikingCNN(nn.Module):
    def __init__(self, tau=2.0, num_classes=2):
        super().__init__()
        self.features = nn.Sequential(
            conv_block(2, 32, tau),
            conv_block(32, 64, tau),
            conv_block(64, 128, tau),
            conv_block(128, 128, tau),
        )
        self.pool = TimeDistributed(nn.AdaptiveAvgPool2d(1))
        self.fc = nn.Linear(128, num_classes)

    def forward(self, x):
        # x: (N, T, 2, H, W) -> (T, N, 2, H, W)
        x = x.transpose(0, 1).contiguous()
        h = self.pool(self.features(x)).flatten(2)
        return self.fc(h).mean(0)  # average logits over time


# ------------------------------------------------------------------------- train
def train_epoch(model, loader, opt, scaler, device):
    model.train()
    tot_loss = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
            loss = F.cross_entropy(logits, y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        tot_loss += torch.stack([loss.detach().float() * y.numel(), torch.tensor(float(y.numel()), device=device)])
    dist.all_reduce(tot_loss)
    return (tot_loss[0] / tot_loss[1]).item()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(x).argmax(1)
        stats[0] += (pred == y).sum()
        stats[1] += y.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(args.seed)

    train_set = NCarsVoxels(args.data, "train", args.bins, args.cache, augment=True)
    test_set = NCarsVoxels(args.data, "test", args.bins, args.cache)
    log.info("train %d / test %d samples", len(train_set), len(test_set))

    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    # test set: no padding, so every sample is counted exactly once
    test_idx = list(range(rank, len(test_set), world))
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    test_loader = DataLoader(torch.utils.data.Subset(test_set, test_idx), batch_size=args.batch_size,
                             num_workers=args.workers, pin_memory=True)

    model = SpikingCNN(tau=args.tau).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wd)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    scaler = torch.cuda.amp.GradScaler(enabled=False)  # bf16 autocast does not need scaling

    writer = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        writer = SummaryWriter(args.out)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        loss = train_epoch(model, train_loader, opt, scaler, device)
        sched.step()
        acc = evaluate(model.module, test_loader, device)
        if rank == 0:
            log.info("epoch %d loss %.4f test acc %.4f (%.0fs)", epoch, loss, acc, time.time() - t0)
            writer.add_scalar("train/loss", loss, epoch)
            writer.add_scalar("test/acc", acc, epoch)
            ckpt = {"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "acc": acc}
            torch.save(ckpt, os.path.join(args.out, "last.pt"))
            if acc > best:
                best = acc
                torch.save(ckpt, os.path.join(args.out, "best.pt"))

    if rank == 0:
        log.info("best test acc %.4f", best)
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
