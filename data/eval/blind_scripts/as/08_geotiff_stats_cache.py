"""
Building footprint segmentation from large multispectral GeoTIFF scenes
(WorldView-3 8-band, SpaceNet-style) with an on-the-fly window sampler.

The first run scans all scenes, builds a chip index (valid windows with
at least some non-nodata pixels) and per-band mean/std, and caches both
next to the data so later runs start immediately.

    torchrun --nproc_per_node=4 train_buildings.py --scenes /data/spacenet/AOI_*/MUL-PS --labels /data/spacenet/masks
"""
import argparse
import glob
import json
import os
import pickle

import numpy as np
import rasterio
from rasterio.windows import Window
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
import segmentation_models_pytorch as smp


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenes", nargs="+", required=True)
    ap.add_argument("--labels", required=True)
    ap.add_argument("--cache-dir", default=None, help="defaults to <labels>/../cache")
    ap.add_argument("--chip", type=int, default=384)
    ap.add_argument("--stride", type=int, default=320)
    ap.add_argument("--min-valid", type=float, default=0.5)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--out", default="runs/buildings_mul")
    return ap.parse_args()


def scan_scenes(scene_paths, label_dir, chip, stride, min_valid):
    index = []
    sums, sq, count = None, None, 0
    for sp in scene_paths:
        lp = os.path.join(label_dir, os.path.basename(sp))
        with rasterio.open(sp) as src:
            nodata = src.nodata if src.nodata is not None else 0
            H, W = src.height, src.width
            for y in range(0, H - chip + 1, stride):
                for x in range(0, W - chip + 1, stride):
                    win = Window(x, y, chip, chip)
                    arr = src.read(window=win, out_dtype="float32")
                    valid = (arr != nodata).any(0)
                    if valid.mean() < min_valid:
                        continue
                    index.append((sp, lp, x, y))
                    px = arr[:, valid].astype(np.float64)
                    if sums is None:
                        sums = np.zeros(arr.shape[0])
                        sq = np.zeros(arr.shape[0])
                    sums += px.sum(1)
                    sq += (px ** 2).sum(1)
                    count += px.shape[1]
    mean = sums / count
    std = np.sqrt(sq / count - mean ** 2)
    return index, mean.astype(np.float32), std.astype(np.float32)


def load_or_build_cache(args):
    cache_dir = args.cache_dir or os.path.join(os.path.dirname(args.labels.rstrip("/")), "cache")
    os.makedirs(cache_dir, exist_ok=True)
    tag = f"c{args.chip}_s{args.stride}_v{args.min_valid}"
    idx_path = os.path.join(cache_dir, f"index_{tag}.pkl")
    stats_path = os.path.join(cache_dir, f"bandstats_{tag}.json")
    if os.path.exists(idx_path) and os.path.exists(stats_path):
        with open(idx_path, "rb") as f:
            index = pickle.load(f)
        with open(stats_path) as f:
            st = json.load(f)
        return index, np.array(st["mean"], np.float32), np.array(st["std"], np.float32)

    scene_paths = sorted(p for pattern in args.scenes for p in glob.glob(os.path.join(pattern, "*.tif")))
    index, mean, std = scan_scenes(scene_paths, args.labels, args.chip, args.stride, args.min_valid)
    with open(idx_path, "wb") as f:
        pickle.dump(index, f)
    with open(stats_path, "w") as f:
        json.dump({"mean": mean.tolist(), "std": std.tolist(), "n_chips": len(index)}, f)
    return index, mean, std


class WindowDataset(Dataset):
    def __init__(self, index, mean, std, chip, train):
        self.index = index
        self.mean = mean[:, None, None]
        self.std = std[:, None, None]
        self.chip = chip
        self.train = train

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        sp, lp, x, y = self.index[i]
        win = Window(x, y, self.chip, self.chip)
        with rasterio.open(sp) as src:
            img = src.read(window=win, out_dtype="float32")
        with rasterio.open(lp) as src:
            mask = src.read(1, window=win).astype(np.float32)
        img = (img - self.mean) / (self.std + 1e-6)
        if self.train:
            k = np.random.randint(4)
            img, mask = np.rot90(img, k, (1, 2)), np.rot90(mask, k)
        return torch.from_numpy(img.copy()), torch.from_numpy(mask.copy())[None]


def split_index(index, val_frac=0.1):
    # hold out whole scenes so val windows never overlap train windows
    scenes = sorted({s for s, _, _, _ in index})
    n_val = max(1, int(round(len(scenes) * val_frac)))
    val_scenes = set(scenes[-n_val:])
    tr = [t for t in index if t[0] not in val_scenes]
    va = [t for t in index if t[0] in val_scenes]
    return tr, va


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    index, mean, std = load_or_build_cache(args)
    tr_idx, va_idx = split_index(index)
    n_bands = len(mean)
    if rank == 0:
        print(f"{len(tr_idx)} train windows, {len(va_idx)} val windows, {n_bands} bands")
        os.makedirs(args.out, exist_ok=True)

    tr_ds = WindowDataset(tr_idx, mean, std, args.chip, train=True)
    va_ds = WindowDataset(va_idx, mean, std, args.chip, train=False)
    tr_sampler = DistributedSampler(tr_ds, shuffle=True)
    va_sampler = DistributedSampler(va_ds, shuffle=False)
    tr_dl = DataLoader(tr_ds, args.bs, sampler=tr_sampler, num_workers=args.workers,
                       pin_memory=True, drop_last=True)
    va_dl = DataLoader(va_ds, args.bs, sampler=va_sampler, num_workers=args.workers, pin_memory=True)

    model = smp.UnetPlusPlus("efficientnet-b4", encoder_weights=None, in_channels=n_bands, classes=1)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs,
                                                steps_per_epoch=len(tr_dl))
    dice = smp.losses.DiceLoss("binary", from_logits=True)
    scaler = torch.cuda.amp.GradScaler()

    best_f1 = 0.0
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        for img, mask in tr_dl:
            img, mask = img.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(img)
                loss = F.binary_cross_entropy_with_logits(logits, mask) + dice(logits, mask)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()

        model.eval()
        counts = torch.zeros(3, device=device, dtype=torch.float64)
        with torch.no_grad():
            for img, mask in va_dl:
                img, mask = img.to(device), mask.to(device)
                pred = (model(img) > 0).float()
                counts[0] += (pred * mask).sum()
                counts[1] += (pred * (1 - mask)).sum()
                counts[2] += ((1 - pred) * mask).sum()
        dist.all_reduce(counts)
        tp, fp, fn = counts.tolist()
        f1 = 2 * tp / max(2 * tp + fp + fn, 1.0)
        if rank == 0:
            print(f"epoch {epoch:02d} loss {loss.item():.4f} pixel-F1 {f1:.4f}", flush=True)
            if f1 > best_f1:
                best_f1 = f1
                torch.save({"model": model.module.state_dict(), "mean": mean, "std": std, "epoch": epoch},
                           os.path.join(args.out, "best.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
