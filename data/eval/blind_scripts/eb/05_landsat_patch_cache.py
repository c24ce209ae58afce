#!/usr/bin/env python
# Landsat 8/9 bi-temporal forest-loss segmentation.
#
# Input scenes are full WRS-2 path/row stacks (~7800 x 7600 px) exported from GEE:
#   scenes/<pathrow>_<date1>_<date2>.tif   bands: 7 SR bands @ t1, 7 SR bands @ t2, loss mask
# The first run cuts them into fixed patches under --cache-dir so later runs
# (and later epochs) only touch small .npy files.
#
#   torchrun --nproc_per_node=8 05_landsat_patch_cache.py --scenes /data/landsat/scenes \
#       --cache-dir /data/landsat/cache_p256 --val-pathrows 227065,227066,228065
import argparse
import glob
import json
import os
import time

import numpy as np
import rasterio
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

NB = 7
NODATA = 0


def cut_scene(path, out_dir, patch, min_valid):
    """Cut one scene into patch .npy files; returns list of (file, pathrow, has_loss)."""
    name = os.path.splitext(os.path.basename(path))[0]
    pathrow = name.split("_")[0]
    entries = []
    with rasterio.open(path) as src:
        arr = src.read()  # (15, H, W) uint16
    img, mask = arr[: 2 * NB], arr[2 * NB]
    valid = (img != NODATA).all(0)
    _, h, w = img.shape
    for r in range(0, h - patch + 1, patch):
        for c in range(0, w - patch + 1, patch):
            if valid[r:r + patch, c:c + patch].mean() < min_valid:
                continue
            f = os.path.join(out_dir, f"{name}_{r}_{c}.npy")
            x = np.concatenate([img[:, r:r + patch, c:c + patch],
                                mask[None, r:r + patch, c:c + patch]], 0)
            np.save(f, x)
            entries.append((os.path.basename(f), pathrow, bool(x[-1].any())))
    return entries


class LandsatLossPatches(Dataset):
    def __init__(self, scene_dir, cache_dir, patch=256, min_valid=0.9):
        manifest = os.path.join(cache_dir, "manifest.json")
        if not os.path.exists(manifest):
            os.makedirs(cache_dir, exist_ok=True)
            entries = []
            for p in sorted(glob.glob(os.path.join(scene_dir, "*.tif"))):
                entries += cut_scene(p, cache_dir, patch, min_valid)
            with open(manifest, "w") as f:
                json.dump(entries, f)
        with open(manifest) as f:
            self.entries = json.load(f)
        self.cache_dir = cache_dir

    def pathrow_indices(self, pathrows, keep):
        return [i for i, (_, pr, _) in enumerate(self.entries) if (pr in pathrows) == keep]

    def __len__(self):
        return len(self.entries)

    def __getitem__(self, i):
        x = np.load(os.path.join(self.cache_dir, self.entries[i][0])).astype(np.float32)
        img = x[:-1] * 2.75e-5 - 0.2  # Collection 2 SR scale/offset
        y = x[-1]
        return torch.from_numpy(np.clip(img, 0, 1)), torch.from_numpy(y)


class ConvGN(nn.Sequential):
    def __init__(self, cin, cout):
        super().__init__(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.GroupNorm(16, cout),
                         nn.GELU(), nn.Conv2d(cout, cout, 3, padding=1, bias=False),
                         nn.GroupNorm(16, cout), nn.GELU())


class SiamDiffUNet(nn.Module):
    """Shared encoder on each date, |f1 - f2| skip connections."""

    def __init__(self, nb=NB, w=(32, 64, 128, 256)):
        super().__init__()
        self.enc = nn.ModuleList([ConvGN(nb if i == 0 else w[i - 1], w[i]) for i in range(len(w))])
        self.dec = nn.ModuleList([ConvGN(w[i] + w[i - 1], w[i - 1]) for i in range(len(w) - 1, 0, -1)])
        self.out = nn.Conv2d(w[0], 1, 1)

    def encode(self, x):
        feats = []
        for i, blk in enumerate(self.enc):
            x = blk(x if i == 0 else F.max_pool2d(x, 2))
            feats.append(x)
        return feats

    def forward(self, x):
        f1, f2 = self.encode(x[:, :NB]), self.encode(x[:, NB:])
        d = [torch.abs(a - b) for a, b in zip(f1, f2)]
        y = d[-1]
        for blk, skip in zip(self.dec, reversed(d[:-1])):
            y = blk(torch.cat([F.interpolate(y, scale_factor=2, mode="nearest"), skip], 1))
        return self.out(y).squeeze(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenes", required=True)
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--val-pathrows", required=True, help="comma separated WRS-2 path/rows held out")
    ap.add_argument("--out", default="runs/landsat_loss")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3, help="for the global batch")
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    ds = LandsatLossPatches(args.scenes, args.cache_dir)
    val_prs = set(args.val_pathrows.split(","))
    train_idx = ds.pathrow_indices(val_prs, keep=False)
    val_idx = ds.pathrow_indices(val_prs, keep=True)
    train_ds, val_ds = Subset(ds, train_idx), Subset(ds, val_idx[rank::world])

    per_gpu = args.bs // world
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    tl = DataLoader(train_ds, per_gpu, sampler=sampler, num_workers=args.workers,
                    pin_memory=True, drop_last=True, persistent_workers=True)
    vl = DataLoader(val_ds, per_gpu, num_workers=args.workers, pin_memory=True)

    model = DDP(SiamDiffUNet().to(dev), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(tl))
    pos_w = torch.tensor(4.0, device=dev)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"train {len(train_ds)} / val {len(val_idx)} patches, {per_gpu} per GPU", flush=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=dev)
        for x, y in tl:
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logit = model(x)
            loss = F.binary_cross_entropy_with_logits(logit.float(), y, pos_weight=pos_w)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=dev)])

        model.eval()
        conf = torch.zeros(3, device=dev, dtype=torch.float64)
        with torch.no_grad():
            for x, y in vl:
                x, y = x.to(dev), y.to(dev)
                p = model.module(x) > 0
                t = y > 0.5
                conf += torch.stack([(p & t).sum(), (p & ~t).sum(), (~p & t).sum()]).double()
        dist.all_reduce(conf)
        dist.all_reduce(loss_sum)
        tp, fp, fn = conf.tolist()
        if rank == 0:
            print(f"epoch {epoch:3d} loss {(loss_sum[0] / loss_sum[1]).item():.4f} "
                  f"F1 {2 * tp / max(1, 2 * tp + fp + fn):.4f} IoU {tp / max(1, tp + fp + fn):.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "args": vars(args)},
                       os.path.join(args.out, f"epoch{epoch:03d}.pt"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
