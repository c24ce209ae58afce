#!/usr/bin/env python3
# Field boundary segmentation (AI4Boundaries-like) on Sentinel-2 monthly composites.
# Tiles are grouped by region (NUTS-2 code in the file name) and the validation set is a
# hold-out of whole regions, so spatial autocorrelation does not leak into the score.
#
#   torchrun --nnodes=1 --nproc_per_node=4 04_region_split_unet.py \
#       --tiles /data/ai4b/s2_tiles --masks /data/ai4b/masks --out /data/runs/fb_unet_r34
import argparse
import os
import random
import re
import time
from collections import defaultdict

import numpy as np
import segmentation_models_pytorch as smp
import torch
import torch.distributed as dist
import torch.nn as nn
import xarray as xr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

TILE_RE = re.compile(r"(?P<region>[A-Z]{2}[0-9A-Z]{2})_(?P<tile>\d+)_S2_10m_256\.nc$")
BANDS = ["B2", "B3", "B4", "B8", "NDVI"]


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiles", required=True)
    ap.add_argument("--masks", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--encoder", default="resnet34")
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--bs", type=int, default=12)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--val-frac", type=float, default=0.15)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1234)
    return ap.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def list_tiles(tile_dir):
    by_region = defaultdict(list)
    for name in sorted(os.listdir(tile_dir)):
        m = TILE_RE.match(name)
        if m:
            by_region[m.group("region")].append(name)
    return by_region


class BoundaryTiles(Dataset):
    def __init__(self, tile_dir, mask_dir, names, augment):
        self.tile_dir = tile_dir
        self.mask_dir = mask_dir
        self.names = names
        self.augment = augment

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        name = self.names[i]
        ds = xr.open_dataset(os.path.join(self.tile_dir, name))
        # (time, y, x) per band -> pick a random month during training, the median otherwise
        if self.augment:
            t = np.random.randint(ds.sizes["time"])
            img = np.stack([ds[b].isel(time=t).values for b in BANDS]).astype(np.float32)
        else:
            img = np.stack([ds[b].median("time").values for b in BANDS]).astype(np.float32)
        ds.close()
        img[:4] = img[:4] / 10000.0
        img = np.nan_to_num(img, nan=0.0)
        mask = np.load(os.path.join(self.mask_dir, name.replace(".nc", ".npy")))  # (3, H, W) extent/boundary/distance
        mask = mask[1:2].astype(np.float32)  # boundary channel
        if self.augment:
            if random.random() < 0.5:
                img, mask = img[..., ::-1], mask[..., ::-1]
            if random.random() < 0.5:
                img, mask = img[..., ::-1, :], mask[..., ::-1, :]
        return torch.from_numpy(img.copy()), torch.from_numpy(mask.copy())


def region_split(by_region, val_frac):
    regions = sorted(by_region)
    random.shuffle(regions)
    n_val = max(1, int(round(len(regions) * val_frac)))
    val_regions = regions[:n_val]
    train_names = [n for r in regions[n_val:] for n in by_region[r]]
    val_names = [n for r in val_regions for n in by_region[r]]
    return train_names, val_names, val_regions


@torch.no_grad()
def evaluate(model, loader, device, thr=0.5):
    model.eval()
    stats = torch.zeros(3, device=device, dtype=torch.float64)  # tp, fp, fn
    for img, mask in loader:
        img, mask = img.to(device, non_blocking=True), mask.to(device, non_blocking=True)
        prob = torch.sigmoid(model(img))
        pred = prob > thr
        gt = mask > 0.5
        stats[0] += (pred & gt).sum()
        stats[1] += (pred & ~gt).sum()
        stats[2] += (~pred & gt).sum()
    dist.all_reduce(stats)
    tp, fp, fn = stats.tolist()
    model.train()
    return {"iou": tp / max(tp + fp + fn, 1.0), "f1": 2 * tp / max(2 * tp + fp + fn, 1.0)}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # each rank draws its own crops / months / flips
    seed_everything(args.seed + rank)

    by_region = list_tiles(args.tiles)
    train_names, val_names, val_regions = region_split(by_region, args.val_frac)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(by_region)} regions, {len(train_names)} train tiles, {len(val_names)} val tiles")
        print("held-out regions:", ", ".join(val_regions))
        with open(os.path.join(args.out, "val_regions.txt"), "w") as f:
            f.write("\n".join(val_regions) + "\n")

    train_ds = BoundaryTiles(args.tiles, args.masks, train_names, augment=True)
    val_ds = BoundaryTiles(args.tiles, args.masks, val_names, augment=False)
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=args.bs,
                        num_workers=args.workers)

    model = smp.Unet(args.encoder, encoder_weights=None, in_channels=len(BANDS), classes=1)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    dice = smp.losses.DiceLoss(mode="binary", from_logits=True)
    bce = nn.BCEWithLogitsLoss(pos_weight=torch.tensor([3.0], device=device))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs,
                                                steps_per_epoch=len(train_dl), pct_start=0.1)

    best = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for img, mask in train_dl:
            img, mask = img.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            logits = model(img)
            loss = bce(logits, mask) + dice(logits, mask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            tot[0] += loss.detach() * img.size(0)
            tot[1] += img.size(0)
        dist.all_reduce(tot)
        scores = evaluate(model.module, val_dl, device)
        if rank == 0:
            print(f"[{epoch:03d}] loss={tot[0].item() / tot[1].item():.4f} val_iou={scores['iou']:.4f} "
                  f"val_f1={scores['f1']:.4f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "opt": opt.state_dict()},
                       os.path.join(args.out, "last.pt"))
            if scores["iou"] > best:
                best = scores["iou"]
                torch.save(model.module.state_dict(), os.path.join(args.out, "best_model.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
