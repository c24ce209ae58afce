#!/usr/bin/env python
"""
3-class nuclei segmentation (background / nucleus interior / boundary) on
whole-slide DAPI scans from the Zeiss Axioscan.

The scans are single huge pyramidal TIFFs; we only read level 0 through a
zarr view, so tiles are cut without loading the whole slide.  Annotations are
sparse label images (same shape, uint16 instance ids, 0 = not annotated /
background).

    torchrun --nproc_per_node=4 03_nuclei_unet_seg.py --config configs/nuclei_dapi.yaml
"""
import argparse
import logging
import os
import time

import numpy as np
import tifffile
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
import zarr
from scipy import ndimage as ndi
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("nuclei")

DEFAULTS = dict(
    slides=[], labels=[], out_dir="runs/nuclei", tile=256, tiles_per_slide=2000,
    batch_size=8, lr=3e-4, epochs=60, workers=8, boundary_weight=3.0, val_fraction=0.1,
)


def load_config(path):
    cfg = dict(DEFAULTS)
    with open(path) as fh:
        cfg.update(yaml.safe_load(fh) or {})
    return argparse.Namespace(**cfg)


def instances_to_classes(lab):
    """0 background, 1 interior, 2 boundary (2px)"""
    fg = lab > 0
    eroded = ndi.grey_erosion(lab, size=3)
    dilated = ndi.grey_dilation(lab, size=3)
    boundary = fg & ((eroded != lab) | (dilated != lab))
    out = fg.astype(np.int64)
    out[boundary] = 2
    return out


class SlideTiles(Dataset):
    """random tiles from level 0 of big pyramidal TIFFs (read lazily via zarr)"""

    def __init__(self, slides, labels, tile, n_tiles, seed):
        self.slides, self.labels = slides, labels
        self.tile = tile
        rng = np.random.default_rng(seed)
        shapes = []
        for s in slides:
            with tifffile.TiffFile(s) as tf:
                shapes.append(tf.series[0].levels[0].shape[-2:])
        # tile origins are fixed up front (same seed on every rank)
        self.index = []
        for i, (H, W) in enumerate(shapes):
            ys = rng.integers(0, H - tile, n_tiles)
            xs = rng.integers(0, W - tile, n_tiles)
            self.index += [(i, int(y), int(x)) for y, x in zip(ys, xs)]
        self._img = self._lab = None

    def _open(self):
        self._img = [zarr.open(tifffile.imread(s, aszarr=True, level=0), mode="r") for s in self.slides]
        self._lab = [tifffile.memmap(l, mode="r") for l in self.labels]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, k):
        if self._img is None:
            self._open()
        i, y, x = self.index[k]
        t = self.tile
        img = np.asarray(self._img[i][y:y + t, x:x + t], dtype=np.float32)
        lab = np.asarray(self._lab[i][y:y + t, x:x + t])
        lo, hi = np.percentile(img, (0.5, 99.8))
        img = np.clip((img - lo) / max(hi - lo, 1.0), 0, 1.5)
        k_rot = np.random.randint(4)
        img, lab = np.rot90(img, k_rot), np.rot90(lab, k_rot)
        target = instances_to_classes(np.ascontiguousarray(lab))
        return torch.from_numpy(img.copy())[None], torch.from_numpy(target)


class DoubleConv(nn.Sequential):
    def __init__(self, cin, cout):
        super().__init__(
            nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.GroupNorm(8, cout), nn.SiLU(inplace=True),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.GroupNorm(8, cout), nn.SiLU(inplace=True),
        )


class UNet(nn.Module):
    def __init__(self, cin=1, ncls=3, widths=(32, 64, 128, 256, 512)):
        super().__init__()
        self.enc = nn.ModuleList()
        c = cin
        for w in widths:
            self.enc.append(DoubleConv(c, w))
            c = w
        self.up = nn.ModuleList()
        self.dec = nn.ModuleList()
        for w in reversed(widths[:-1]):
            self.up.append(nn.ConvTranspose2d(c, w, 2, stride=2))
            self.dec.append(DoubleConv(2 * w, w))
            c = w
        self.out = nn.Conv2d(c, ncls, 1)

    def forward(self, x):
        skips = []
        for i, blk in enumerate(self.enc):
            x = blk(x if i == 0 else F.max_pool2d(x, 2))
            skips.append(x)
        skips.pop()
        for up, dec in zip(self.up, self.dec):
            x = up(x)
            x = dec(torch.cat([x, skips.pop()], 1))
        return self.out(x)


def dice_per_class(logits, target, ncls=3):
    pred = logits.argmax(1)
    inter = torch.stack([((pred == c) & (target == c)).sum() for c in range(ncls)]).float()
    total = torch.stack([(pred == c).sum() + (target == c).sum() for c in range(ncls)]).float()
    return inter, total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = load_config(ap.parse_args().config)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")

    ds = SlideTiles(cfg.slides, cfg.labels, cfg.tile, cfg.tiles_per_slide, seed=1234)
    n_val = int(len(ds) * cfg.val_fraction)
    gen = torch.Generator().manual_seed(1234)
    train_ds, val_ds = torch.utils.data.random_split(ds, [len(ds) - n_val, n_val], generator=gen)

    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, cfg.batch_size, sampler=train_sampler, num_workers=cfg.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, cfg.batch_size, sampler=val_sampler, num_workers=cfg.workers)

    model = DDP(UNet().to(dev), device_ids=[local_rank])
    # global batch is batch_size * world; lr follows linearly from the 1-GPU setting
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr * world, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, cfg.epochs * len(train_dl))
    class_w = torch.tensor([1.0, 1.0, cfg.boundary_weight], device=dev)

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
    best_dice = 0.0

    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, seen, loss_acc = time.time(), 0, 0.0
        for img, tgt in train_dl:
            if tgt.max() == 0:
                # tile batch fell entirely outside the annotated regions
                continue
            img, tgt = img.to(dev, non_blocking=True), tgt.to(dev, non_blocking=True)
            logits = model(img)
            loss = F.cross_entropy(logits, tgt, weight=class_w)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            loss_acc += loss.item()
            seen += 1

        model.eval()
        inter = torch.zeros(3, device=dev)
        total = torch.zeros(3, device=dev)
        with torch.no_grad():
            for img, tgt in val_dl:
                img, tgt = img.to(dev), tgt.to(dev)
                i_, t_ = dice_per_class(model.module(img), tgt)
                inter += i_
                total += t_
        dist.all_reduce(inter)
        dist.all_reduce(total)
        dice = (2 * inter / total.clamp(min=1)).cpu().numpy()
        mean_fg_dice = float(dice[1:].mean())

        if rank == 0:
            log.info("ep %d  train %.4f (%d batches)  dice bg %.3f nuc %.3f bnd %.3f  %.0fs",
                     epoch, loss_acc / max(seen, 1), seen, *dice, time.time() - t0)
            ckpt = {"epoch": epoch, "model": model.module.state_dict(), "cfg": vars(cfg)}
            torch.save(ckpt, os.path.join(cfg.out_dir, "last.pt"))
            if mean_fg_dice > best_dice:
                best_dice = mean_fg_dice
                torch.save(ckpt, os.path.join(cfg.out_dir, "best.pt"))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
