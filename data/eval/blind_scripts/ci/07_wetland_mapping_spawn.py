"""Wetland mapping from Sentinel-2 + DEM mosaics, single node, multi-GPU via mp.spawn.

The mosaics are very large (~60k x 60k px), so they are cut once into a uint16
patch cache (one .npy memmap per mosaic plus an index) on the group share; the
cache is built by one process and re-used by every later run.

    python 07_wetland_mapping_spawn.py --mosaics /gpfs/wetlands/mosaics \
        --cache /gpfs/wetlands/patch_cache --gpus 4
"""
import argparse
import datetime
import json
import os
import socket
from contextlib import closing
from pathlib import Path

import numpy as np
import rasterio
from rasterio.windows import Window
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
import segmentation_models_pytorch as smp

CLASSES = ["upland", "open_water", "emergent", "scrub_shrub", "forested_wetland", "bog"]
IGNORE = 255
PATCH = 256


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mosaics", type=Path, required=True)
    ap.add_argument("--cache", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path("/gpfs/wetlands/runs/unet_s2dem"))
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--resume", action="store_true")
    return ap.parse_args()


def free_port():
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def build_cache(mosaic_dir, cache_dir):
    """Cut every mosaic into PATCH x PATCH tiles with at least 30% labelled pixels."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    index = []
    for mosaic in sorted(mosaic_dir.glob("*_s2dem.tif")):
        lbl_path = str(mosaic).replace("_s2dem.tif", "_labels.tif")
        with rasterio.open(mosaic) as img_src, rasterio.open(lbl_path) as lbl_src:
            tiles = []
            for y in range(0, img_src.height - PATCH + 1, PATCH):
                for x in range(0, img_src.width - PATCH + 1, PATCH):
                    win = Window(x, y, PATCH, PATCH)
                    lbl = lbl_src.read(1, window=win)
                    if (lbl != IGNORE).mean() < 0.3:
                        continue
                    img = img_src.read(window=win)
                    tiles.append((img, lbl))
            n_bands = img_src.count
        if not tiles:
            continue
        name = mosaic.stem
        imgs = np.lib.format.open_memmap(cache_dir / f"{name}_img.npy.tmp", mode="w+",
                                         dtype=np.uint16, shape=(len(tiles), n_bands, PATCH, PATCH))
        lbls = np.lib.format.open_memmap(cache_dir / f"{name}_lbl.npy.tmp", mode="w+",
                                         dtype=np.uint8, shape=(len(tiles), PATCH, PATCH))
        for k, (im, lb) in enumerate(tiles):
            imgs[k], lbls[k] = im, lb
        imgs.flush(), lbls.flush()
        del imgs, lbls
        os.replace(cache_dir / f"{name}_img.npy.tmp", cache_dir / f"{name}_img.npy")
        os.replace(cache_dir / f"{name}_lbl.npy.tmp", cache_dir / f"{name}_lbl.npy")
        index.append({"name": name, "n": len(tiles), "val": name.endswith(("_07", "_13"))})
    with open(cache_dir / "index.json.tmp", "w") as f:
        json.dump(index, f)
    os.replace(cache_dir / "index.json.tmp", cache_dir / "index.json")


class CachedPatches(Dataset):
    def __init__(self, cache_dir, entries, mean, std, train):
        self.cache_dir, self.entries, self.train = cache_dir, entries, train
        self.offsets = np.cumsum([0] + [e["n"] for e in entries])
        self.mean = np.asarray(mean, np.float32)[:, None, None]
        self.std = np.asarray(std, np.float32)[:, None, None]
        self._arrays = {}   # opened lazily inside each worker

    def __len__(self):
        return int(self.offsets[-1])

    def _get(self, name):
        if name not in self._arrays:
            self._arrays[name] = (np.load(self.cache_dir / f"{name}_img.npy", mmap_mode="r"),
                                  np.load(self.cache_dir / f"{name}_lbl.npy", mmap_mode="r"))
        return self._arrays[name]

    def __getitem__(self, i):
        e = int(np.searchsorted(self.offsets, i, side="right") - 1)
        imgs, lbls = self._get(self.entries[e]["name"])
        k = i - self.offsets[e]
        img = (imgs[k].astype(np.float32) - self.mean) / self.std
        lbl = lbls[k].astype(np.int64)
        if self.train:
            r = np.random.randint(4)
            img, lbl = np.rot90(img, r, (1, 2)), np.rot90(lbl, r)
            if np.random.rand() < 0.5:
                img, lbl = img[:, ::-1], lbl[::-1]
        return torch.from_numpy(img.copy()), torch.from_numpy(lbl.copy())


def band_stats(cache_dir, entries, max_tiles=2000):
    sums, sqs, n = 0.0, 0.0, 0
    for e in entries:
        imgs = np.load(cache_dir / f"{e['name']}_img.npy", mmap_mode="r")
        sel = imgs[: max(1, max_tiles // len(entries))].astype(np.float64)
        sums = sums + sel.sum((0, 2, 3))
        sqs = sqs + (sel ** 2).sum((0, 2, 3))
        n += sel.shape[0] * PATCH * PATCH
    mean = sums / n
    return mean, np.sqrt(sqs / n - mean ** 2)


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    # cutting the mosaics on first use takes well over the default collective timeout
    dist.init_process_group("nccl", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(hours=4))
    device = torch.device("cuda", rank)

    if rank == 0 and not (args.cache / "index.json").exists():
        print("building patch cache ...", flush=True)
        build_cache(args.mosaics, args.cache)
    dist.barrier()

    with open(args.cache / "index.json") as f:
        index = json.load(f)
    train_entries = [e for e in index if not e["val"]]
    val_entries = [e for e in index if e["val"]]
    mean, std = band_stats(args.cache, train_entries)
    train_ds = CachedPatches(args.cache, train_entries, mean, std, train=True)
    val_ds = CachedPatches(args.cache, val_entries, mean, std, train=False)

    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_idx = np.array_split(np.arange(len(val_ds)), world_size)[rank]
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, val_idx.tolist()),
                        batch_size=args.batch_size, num_workers=4)

    torch.manual_seed(0)
    net = smp.Unet("resnet50", encoder_weights=None, in_channels=len(mean), classes=len(CLASSES))
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr * world_size, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    start = 0
    ckpt_path = args.out / "last.pth"
    if args.resume and ckpt_path.exists():
        ck = torch.load(ckpt_path, map_location=device)
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start = ck["epoch"] + 1
    model = DDP(net, device_ids=[rank])

    # class-balanced CE: frequencies from the cached training labels (same on every rank)
    counts = np.zeros(len(CLASSES))
    for e in train_entries:
        lb = np.load(args.cache / f"{e['name']}_lbl.npy", mmap_mode="r")[::10]
        counts += np.bincount(lb[lb != IGNORE].ravel(), minlength=len(CLASSES))[: len(CLASSES)]
    weight = torch.tensor(np.median(counts) / np.maximum(counts, 1), dtype=torch.float32, device=device)
    criterion = nn.CrossEntropyLoss(weight=weight, ignore_index=IGNORE)

    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
    nc = len(CLASSES)
    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for i, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = criterion(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and i % 100 == 0:
                print(f"epoch {epoch} [{i}/{len(train_dl)}] loss {loss.item():.4f}", flush=True)
        sched.step()

        net.eval()
        cm = torch.zeros(nc, nc, dtype=torch.int64, device=device)
        with torch.no_grad():
            for x, y in val_dl:
                x, y = x.to(device), y.to(device)
                p = net(x).argmax(1)
                m = y != IGNORE
                cm += torch.bincount(y[m] * nc + p[m], minlength=nc * nc).view(nc, nc)
        dist.all_reduce(cm)
        inter = cm.diag().double()
        iou = inter / (cm.sum(0) + cm.sum(1) - cm.diag()).double().clamp(min=1)
        if rank == 0:
            print(f"epoch {epoch} mIoU {iou.mean():.4f} "
                  + ", ".join(f"{c} {v:.3f}" for c, v in zip(CLASSES, iou.tolist())), flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch,
                        "mean": mean.tolist(), "std": std.tolist()}, ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)
