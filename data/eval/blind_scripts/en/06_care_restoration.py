#!/usr/bin/env python
"""
CARE-style 3D content-aware restoration (low laser power -> high SNR).

Training pairs were acquired on the spinning disk with two laser powers and
registered with ``register_pairs.py``.  Files:
    <root>/low/<id>.tif   (Z, Y, X) uint16
    <root>/high/<id>.tif  (Z, Y, X) uint16

Patches of 16x96x96 are drawn from the stacks; the low- and high-SNR patches
are normalised jointly with CSBDeep's percentile scheme (low: 1/99.8 of the
low patch, high: 1/99.8 of the high patch).

Multi-node launch on the facility cluster (shared /groups filesystem):
    torchrun --nnodes=2 --nproc_per_node=4 --rdzv_backend=c10d \
        --rdzv_endpoint=$HEAD_NODE:29500 06_care_restoration.py \
        --root /groups/imaging/care/planaria --out /groups/imaging/care/runs/planaria_v3 \
        --resume /groups/imaging/care/runs/planaria_v3/last.pt
"""
import argparse
import glob
import os
import time

import numpy as np
import tifffile
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--patch", type=int, nargs=3, default=[16, 96, 96])
    ap.add_argument("--patches-per-stack", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4, help="per GPU")
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--epochs", type=int, default=150)
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


def pnorm(x, pmin=1.0, pmax=99.8, eps=1e-20):
    lo, hi = np.percentile(x, [pmin, pmax])
    return (x - lo) / (hi - lo + eps)


class CarePatches(Dataset):
    def __init__(self, ids, root, patch, n_per_stack, seed=0):
        self.ids, self.root, self.patch = ids, root, patch
        rng = np.random.default_rng(seed)
        self.items = []
        for i, sid in enumerate(ids):
            shape = tifffile.TiffFile(os.path.join(root, "low", sid + ".tif")).series[0].shape
            for _ in range(n_per_stack):
                self.items.append((i, *[int(rng.integers(0, s - p + 1)) for s, p in zip(shape, patch)]))
        self._cache = {}

    def _stack(self, i):
        if i not in self._cache:
            sid = self.ids[i]
            self._cache[i] = (tifffile.memmap(os.path.join(self.root, "low", sid + ".tif"), mode="r"),
                              tifffile.memmap(os.path.join(self.root, "high", sid + ".tif"), mode="r"))
        return self._cache[i]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, k):
        i, z, y, x = self.items[k]
        dz, dy, dx = self.patch
        low, high = self._stack(i)
        lo = pnorm(np.asarray(low[z:z + dz, y:y + dy, x:x + dx], dtype=np.float32))
        hi = pnorm(np.asarray(high[z:z + dz, y:y + dy, x:x + dx], dtype=np.float32))
        if np.random.rand() < 0.5:
            lo, hi = lo[:, :, ::-1], hi[:, :, ::-1]
        r = np.random.randint(4)
        lo, hi = np.rot90(lo, r, axes=(1, 2)), np.rot90(hi, r, axes=(1, 2))
        return torch.from_numpy(lo.copy())[None], torch.from_numpy(hi.copy())[None]


class Conv3dBlock(nn.Sequential):
    def __init__(self, cin, cout):
        super().__init__(nn.Conv3d(cin, cout, 3, padding=1), nn.ReLU(inplace=True),
                         nn.Conv3d(cout, cout, 3, padding=1), nn.ReLU(inplace=True))


class CareUNet3D(nn.Module):
    """CSBDeep default: depth 2, 32 base filters, residual, pooling only in XY for thin stacks"""

    def __init__(self, base=32):
        super().__init__()
        self.e0 = Conv3dBlock(1, base)
        self.e1 = Conv3dBlock(base, base * 2)
        self.mid = Conv3dBlock(base * 2, base * 4)
        self.u1 = nn.Upsample(scale_factor=(1, 2, 2), mode="trilinear", align_corners=False)
        self.d1 = Conv3dBlock(base * 4 + base * 2, base * 2)
        self.u0 = nn.Upsample(scale_factor=(1, 2, 2), mode="trilinear", align_corners=False)
        self.d0 = Conv3dBlock(base * 2 + base, base)
        self.out = nn.Conv3d(base, 1, 1)
        self.pool = nn.MaxPool3d((1, 2, 2))

    def forward(self, x):
        a = self.e0(x)
        b = self.e1(self.pool(a))
        m = self.mid(self.pool(b))
        y = self.d1(torch.cat([self.u1(m), b], 1))
        y = self.d0(torch.cat([self.u0(y), a], 1))
        return x + self.out(y)


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    ids = sorted(os.path.basename(f)[:-4] for f in glob.glob(os.path.join(args.root, "low", "*.tif")))
    val_ids, train_ids = ids[:2], ids[2:]  # first two stacks are held out (fixed, same on all ranks)
    train_ds = CarePatches(train_ids, args.root, args.patch, args.patches_per_stack, seed=0)
    val_ds = CarePatches(val_ids, args.root, args.patch, 64, seed=1)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, list(range(rank, len(val_ds), world))),
                        batch_size=args.batch, num_workers=2)

    model = CareUNet3D().to(dev)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world ** 0.5)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=10, min_lr=1e-6)

    start_epoch, best = 0, float("inf")
    if args.resume and os.path.exists(args.resume):
        ckpt = torch.load(args.resume)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]
        if rank == 0:
            print(f"resumed from {args.resume} at epoch {start_epoch}", flush=True)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tr = torch.zeros(2, device=dev)
        for lo, hi in train_dl:
            lo, hi = lo.to(dev, non_blocking=True), hi.to(dev, non_blocking=True)
            loss = F.l1_loss(model(lo), hi)  # CARE uses MAE for restoration
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tr += torch.stack([loss.detach(), torch.ones((), device=dev)])

        model.eval()
        va = torch.zeros(2, device=dev)
        with torch.no_grad():
            for lo, hi in val_dl:
                lo, hi = lo.to(dev), hi.to(dev)
                va[0] += F.l1_loss(model.module(lo), hi, reduction="sum") / lo[0].numel()
                va[1] += lo.shape[0]
        dist.all_reduce(tr)
        dist.all_reduce(va)
        train_mae, val_mae = (tr[0] / tr[1]).item(), (va[0] / va[1]).item()
        sched.step(val_mae)

        if rank == 0:
            print(f"[{epoch:03d}] train MAE {train_mae:.4f}  val MAE {val_mae:.4f}  "
                  f"lr {opt.param_groups[0]['lr']:.2e}  {time.time() - t0:.0f}s", flush=True)
            best = min(best, val_mae)
            ckpt = {"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                    "epoch": epoch, "best": best}
            torch.save(ckpt, os.path.join(args.out, "last.pt"))
            if val_mae <= best:
                torch.save(ckpt, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
