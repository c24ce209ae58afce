"""Nuclei foreground + boundary prediction for light-sheet stacks (PlantSeg-like pipeline).

The network predicts two channels (foreground, boundary); instances are obtained later
with watershed on the boundary map (see segment_instances.py).

Data layout: <root>/<stack>/raw.zarr (ZYX uint16) and <root>/<stack>/labels.zarr (instance ids)

    torchrun --nproc_per_node=8 06_lightsheet_nuclei_boundary.py --root /fast/lightsheet/nuclei \
        --train-stacks E1 E2 E3 E5 E6 --val-stacks E4 --out /fast/lightsheet/runs/nuc_b2
"""
import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import zarr
from scipy import ndimage
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--train-stacks", nargs="+", required=True)
    ap.add_argument("--val-stacks", nargs="+", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--patch", type=int, nargs=3, default=[48, 160, 160])
    ap.add_argument("--samples-per-epoch", type=int, default=8000)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--resume", action="store_true")
    return ap.parse_args()


def boundary_from_instances(lab):
    fg = lab > 0
    grad = np.zeros_like(fg)
    for ax in range(lab.ndim):
        d = np.diff(lab, axis=ax) != 0
        sl_a = [slice(None)] * lab.ndim
        sl_b = [slice(None)] * lab.ndim
        sl_a[ax], sl_b[ax] = slice(1, None), slice(None, -1)
        grad[tuple(sl_a)] |= d
        grad[tuple(sl_b)] |= d
    bnd = ndimage.binary_dilation(grad, iterations=1) & (fg | grad)
    return np.stack([fg, bnd]).astype(np.float32)


class RandomPatches(Dataset):
    """Draws a random patch from a random stack on every call; length only sets the epoch size."""

    def __init__(self, root, stacks, patch, length, augment=True):
        self.raw = [zarr.open(os.path.join(root, s, "raw.zarr"), mode="r") for s in stacks]
        self.lab = [zarr.open(os.path.join(root, s, "labels.zarr"), mode="r") for s in stacks]
        self.patch, self.length, self.augment = patch, length, augment
        self.p_lo, self.p_hi = [], []
        for r in self.raw:
            sub = np.asarray(r[::8, ::8, ::8], dtype=np.float32)
            self.p_lo.append(np.percentile(sub, 1))
            self.p_hi.append(np.percentile(sub, 99.8))

    def __len__(self):
        return self.length

    def __getitem__(self, _):
        s = random.randrange(len(self.raw))
        shape = self.raw[s].shape
        o = [random.randint(0, d - p) for d, p in zip(shape, self.patch)]
        sl = tuple(slice(a, a + p) for a, p in zip(o, self.patch))
        raw = np.asarray(self.raw[s][sl], dtype=np.float32)
        lab = np.asarray(self.lab[s][sl])
        raw = (raw - self.p_lo[s]) / (self.p_hi[s] - self.p_lo[s] + 1e-6)
        tgt = boundary_from_instances(lab)
        if self.augment:
            for ax in (1, 2):
                if random.random() < 0.5:
                    raw, tgt = np.flip(raw, ax - 1), np.flip(tgt, ax)
            raw = raw * random.uniform(0.8, 1.2) + random.gauss(0, 0.05)
        return torch.from_numpy(raw.copy())[None], torch.from_numpy(tgt.copy())


def cbr(i, o):
    return [nn.Conv3d(i, o, 3, padding=1, bias=False), nn.GroupNorm(min(8, o // 4), o), nn.ELU(inplace=True)]


class ResidualUNet3D(nn.Module):
    def __init__(self, f=(32, 64, 128, 256)):
        super().__init__()
        self.enc = nn.ModuleList()
        prev = 1
        for c in f:
            self.enc.append(nn.Sequential(*cbr(prev, c), *cbr(c, c)))
            prev = c
        self.ups = nn.ModuleList([nn.Upsample(scale_factor=(1, 2, 2) if i == 0 else 2, mode="trilinear")
                                  for i in range(len(f) - 1)])
        self.dec = nn.ModuleList([nn.Sequential(*cbr(f[i] + f[i + 1], f[i]), *cbr(f[i], f[i]))
                                  for i in reversed(range(len(f) - 1))])
        self.final = nn.Conv3d(f[0], 2, 1)

    def forward(self, x):
        feats = []
        for i, e in enumerate(self.enc):
            if i > 0:
                x = F.max_pool3d(x, (1, 2, 2) if i == 1 else 2)
            x = e(x)
            feats.append(x)
        x = feats.pop()
        for j, d in enumerate(self.dec):
            skip = feats.pop()
            x = F.interpolate(x, size=skip.shape[2:], mode="trilinear", align_corners=False)
            x = d(torch.cat([skip, x], 1))
        return self.final(x)


def loss_fn(logits, tgt):
    bce = F.binary_cross_entropy_with_logits(logits, tgt)
    p = torch.sigmoid(logits)
    dims = (0, 2, 3, 4)
    dice = 1 - ((2 * (p * tgt).sum(dims) + 1) / (p.sum(dims) + tgt.sum(dims) + 1)).mean()
    return bce + dice


def save_checkpoint(path, model, opt, sched, epoch, best):
    torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(), "epoch": epoch, "best": best}, path)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_master = rank == 0

    # per-rank seeds so that the random patch draws differ between GPUs
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    per_gpu = args.global_batch // world
    train_ds = RandomPatches(args.root, args.train_stacks, args.patch, args.samples_per_epoch)
    val_ds = RandomPatches(args.root, args.val_stacks, args.patch, 64 * world, augment=False)
    train_sampler = DistributedSampler(train_ds)
    train_loader = DataLoader(train_ds, per_gpu, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, per_gpu, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=2)

    model = ResidualUNet3D().to(device)  # DDP broadcasts rank 0's initial weights
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=8)

    os.makedirs(args.out, exist_ok=True)
    last_path = os.path.join(args.out, "last_checkpoint.pytorch")
    best_path = os.path.join(args.out, "best_checkpoint.pytorch")
    start, best = 0, float("inf")
    if args.resume and os.path.exists(last_path):
        ck = torch.load(last_path, map_location=device)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        start, best = ck["epoch"] + 1, ck["best"]

    for epoch in range(start, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tr = torch.zeros(2, device=device)
        for it, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = loss_fn(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tr += torch.stack([loss.detach(), torch.ones_like(loss)])

        model.eval()
        vl = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device), y.to(device)
                vl += torch.stack([loss_fn(model.module(x), y), torch.ones((), device=device)])
        dist.all_reduce(tr)
        dist.all_reduce(vl)
        train_loss, val_loss = (tr[0] / tr[1]).item(), (vl[0] / vl[1]).item()
        sched.step(val_loss)

        if is_master:
            print(f"[{time.strftime('%H:%M:%S')}] epoch {epoch} train {train_loss:.4f} "
                  f"val {val_loss:.4f} lr {opt.param_groups[0]['lr']:.1e} ({time.time() - t0:.0f}s)",
                  flush=True)
        is_best = val_loss < best
        best = min(best, val_loss)
        save_checkpoint(last_path, model, opt, sched, epoch, best)
        if is_best:
            save_checkpoint(best_path, model, opt, sched, epoch, best)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
