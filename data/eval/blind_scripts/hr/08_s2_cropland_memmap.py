"""Cropland / non-cropland segmentation from Sentinel-2 (12 bands, L2A).

Reading windows out of the full GeoTIFF tiles at every step was the bottleneck, so the
training patches are extracted once into a single uint16 memmap (+ label memmap) and
every later epoch reads from there.

    torchrun --standalone --nproc_per_node=4 08_s2_cropland_memmap.py --config configs/cropland.yaml
"""
import argparse
import logging
import os
import time
from pathlib import Path

import numpy as np
import rasterio
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger(__name__)

DEFAULTS = {
    "tiles_dir": "/data/cropland/tiles",
    "cache_dir": "/data/cropland/cache",
    "out_dir": "/data/cropland/runs/unet_s2",
    "patch": 128,
    "n_bands": 12,
    "batch_size": 32,
    "epochs": 40,
    "lr": 1e-3,
    "workers": 6,
    "val_tiles": ["T31UFS", "T32ULU"],
}


def conv_block(cin, cout):
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
    )


class UNet(nn.Module):
    def __init__(self, in_ch, n_classes=2, width=48):
        super().__init__()
        chs = [width, width * 2, width * 4, width * 8]
        self.downs = nn.ModuleList()
        c = in_ch
        for ch in chs:
            self.downs.append(conv_block(c, ch))
            c = ch
        self.bottleneck = conv_block(chs[-1], chs[-1] * 2)
        self.ups = nn.ModuleList()
        self.up_convs = nn.ModuleList()
        c = chs[-1] * 2
        for ch in reversed(chs):
            self.ups.append(nn.ConvTranspose2d(c, ch, 2, stride=2))
            self.up_convs.append(conv_block(ch * 2, ch))
            c = ch
        self.head = nn.Conv2d(chs[0], n_classes, 1)

    def forward(self, x):
        skips = []
        for down in self.downs:
            x = down(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        x = self.bottleneck(x)
        for up, conv, skip in zip(self.ups, self.up_convs, reversed(skips)):
            x = conv(torch.cat([up(x), skip], 1))
        return self.head(x)


def extract_patches(tile_paths, patch, n_bands, cache_dir, split):
    """Cut every tile into non-overlapping patches and store them in memmaps."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    img_file = cache_dir / f"{split}_img_{patch}.npy"
    lab_file = cache_dir / f"{split}_lab_{patch}.npy"
    if img_file.exists() and lab_file.exists():
        return np.load(img_file, mmap_mode="r"), np.load(lab_file, mmap_mode="r")

    windows = []
    for tp in tile_paths:
        with rasterio.open(tp) as src:
            h, w = src.height, src.width
        windows += [(tp, y, x) for y in range(0, h - patch + 1, patch) for x in range(0, w - patch + 1, patch)]
    log.info("extracting %d %s patches into %s", len(windows), split, cache_dir)

    imgs = np.lib.format.open_memmap(img_file, mode="w+", dtype=np.uint16, shape=(len(windows), n_bands, patch, patch))
    labs = np.lib.format.open_memmap(lab_file, mode="w+", dtype=np.uint8, shape=(len(windows), patch, patch))
    current, src_img, src_lab = None, None, None
    for k, (tp, y, x) in enumerate(windows):
        if tp != current:
            if src_img is not None:
                src_img.close()
                src_lab.close()
            src_img = rasterio.open(tp)
            src_lab = rasterio.open(str(tp).replace("_S2L2A.tif", "_mask.tif"))
            current = tp
        win = rasterio.windows.Window(x, y, patch, patch)
        imgs[k] = src_img.read(window=win)
        labs[k] = src_lab.read(1, window=win)
    src_img.close()
    src_lab.close()
    imgs.flush()
    labs.flush()
    return np.load(img_file, mmap_mode="r"), np.load(lab_file, mmap_mode="r")


class MemmapPatches(Dataset):
    def __init__(self, imgs, labs, augment):
        self.imgs, self.labs, self.augment = imgs, labs, augment

    def __len__(self):
        return len(self.imgs)

    def __getitem__(self, i):
        img = self.imgs[i].astype(np.float32) / 10000.0
        lab = self.labs[i].astype(np.int64)
        if self.augment:
            if np.random.rand() < 0.5:
                img, lab = img[:, ::-1], lab[::-1]
            if np.random.rand() < 0.5:
                img, lab = img[:, :, ::-1], lab[:, ::-1]
        img = np.clip(img, 0, 1.5)
        return torch.from_numpy(img.copy()), torch.from_numpy(lab.copy())


def iou_stats(logits, target):
    pred = logits.argmax(1)
    valid = target != 255
    tp = ((pred == 1) & (target == 1) & valid).sum()
    fp = ((pred == 1) & (target == 0) & valid).sum()
    fn = ((pred == 0) & (target == 1) & valid).sum()
    return torch.stack([tp, fp, fn]).double()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", type=str, default=None)
    cli = ap.parse_args()
    cfg = dict(DEFAULTS)
    if cli.config:
        with open(cli.config) as f:
            cfg.update(yaml.safe_load(f))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(levelname)s %(message)s")

    tiles = sorted(Path(cfg["tiles_dir"]).glob("*_S2L2A.tif"))
    val_tiles = [t for t in tiles if any(v in t.name for v in cfg["val_tiles"])]
    train_tiles = [t for t in tiles if t not in val_tiles]
    cache_dir = Path(cfg["cache_dir"])
    tr_img, tr_lab = extract_patches(train_tiles, cfg["patch"], cfg["n_bands"], cache_dir, "train")
    va_img, va_lab = extract_patches(val_tiles, cfg["patch"], cfg["n_bands"], cache_dir, "val")

    train_ds = MemmapPatches(tr_img, tr_lab, augment=True)
    val_ds = MemmapPatches(va_img, va_lab, augment=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    # strided shard, no padding: every val patch is counted exactly once
    val_ds = Subset(val_ds, range(rank, len(val_ds), world))
    train_dl = DataLoader(train_ds, cfg["batch_size"], sampler=train_sampler,
                          num_workers=cfg["workers"], pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, cfg["batch_size"] * 2, shuffle=False,
                        num_workers=cfg["workers"], pin_memory=True)

    model = UNet(cfg["n_bands"]).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg["lr"], epochs=cfg["epochs"],
                                                steps_per_epoch=len(train_dl))
    # cropland is ~25% of pixels
    crit = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 3.0], device=device), ignore_index=255)
    scaler = torch.cuda.amp.GradScaler()

    out_dir = Path(cfg["out_dir"])
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
    best = 0.0
    for epoch in range(cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, loss_sum, n = time.time(), torch.zeros((), device=device), 0
        for img, lab in train_dl:
            img, lab = img.to(device, non_blocking=True), lab.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = crit(model(img), lab)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            loss_sum += loss.detach()
            n += 1
        loss_sum /= n
        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)

        model.eval()
        stats = torch.zeros(3, dtype=torch.float64, device=device)
        with torch.no_grad():
            for img, lab in val_dl:
                img, lab = img.to(device, non_blocking=True), lab.to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.float16):
                    logits = model(img)
                stats += iou_stats(logits.float(), lab)
        dist.all_reduce(stats)
        tp, fp, fn = stats.tolist()
        iou = tp / max(tp + fp + fn, 1.0)

        if rank == 0:
            log.info("epoch %03d  loss %.4f  IoU(crop) %.4f  %.0fs", epoch, loss_sum.item(), iou, time.time() - t0)
            ckpt = {"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "iou": iou, "cfg": cfg}
            torch.save(ckpt, out_dir / "last.pt")
            if iou > best:
                best = iou
                torch.save(ckpt, out_dir / "best.pt")

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
