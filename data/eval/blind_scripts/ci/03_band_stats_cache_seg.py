"""Land-cover segmentation straight from full Landsat-8 / Sentinel-2 scenes.

Scenes are never cut to disk: a tile index of (scene, window) pairs with enough
valid pixels is built once and kept, together with per-band statistics, in a
cache folder on the project share so that later runs start immediately.

    torchrun --nnodes=1 --nproc_per_node=8 03_band_stats_cache_seg.py \
        --scenes /proj/geo/scenes/*.tif --cache /proj/geo/cache
"""
import argparse
import glob
import hashlib
import json
import os
import time

import numpy as np
import rasterio
from rasterio.windows import Window
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

NODATA_LABEL = 0          # class 0 in the label rasters means "no label"
NUM_CLASSES = 9           # 8 land-cover classes + nodata


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenes", nargs="+", required=True, help="image GeoTIFFs; labels are *_lc.tif")
    ap.add_argument("--cache", required=True)
    ap.add_argument("--tile", type=int, default=512)
    ap.add_argument("--stride", type=int, default=384)
    ap.add_argument("--min-valid", type=float, default=0.6)
    ap.add_argument("--val-fraction", type=float, default=0.1)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--bs", type=int, default=6)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--ckpt-dir", default="/proj/geo/ckpt/lc_scenes")
    return ap.parse_args()


def label_path(scene):
    return scene.replace(".tif", "_lc.tif")


def build_index(scenes, tile, stride, min_valid):
    """Enumerate windows whose label coverage is above min_valid."""
    index = []
    for s_id, scene in enumerate(scenes):
        with rasterio.open(label_path(scene)) as src:
            lbl = src.read(1, out_shape=(src.height // 8, src.width // 8))  # coarse look-up
            H, W = src.height, src.width
        for y in range(0, H - tile + 1, stride):
            for x in range(0, W - tile + 1, stride):
                sub = lbl[y // 8:(y + tile) // 8, x // 8:(x + tile) // 8]
                if sub.size and (sub != NODATA_LABEL).mean() >= min_valid:
                    index.append([s_id, y, x])
    return index


def band_statistics(scenes, n_samples=200_000, seed=0):
    rng = np.random.default_rng(seed)
    acc_sum, acc_sq, n = None, None, 0
    for scene in scenes:
        with rasterio.open(scene) as src:
            arr = src.read(out_shape=(src.count, src.height // 16, src.width // 16)).astype(np.float64)
            nodata = src.nodata
        flat = arr.reshape(arr.shape[0], -1)
        valid = np.all(flat != nodata, axis=0) if nodata is not None else np.ones(flat.shape[1], bool)
        flat = flat[:, valid]
        if flat.shape[1] > n_samples:
            flat = flat[:, rng.choice(flat.shape[1], n_samples, replace=False)]
        acc_sum = flat.sum(1) if acc_sum is None else acc_sum + flat.sum(1)
        acc_sq = (flat ** 2).sum(1) if acc_sq is None else acc_sq + (flat ** 2).sum(1)
        n += flat.shape[1]
    mean = acc_sum / n
    std = np.sqrt(acc_sq / n - mean ** 2)
    return mean.tolist(), std.tolist()


def load_or_build_cache(args, scenes):
    key = hashlib.md5(json.dumps([scenes, args.tile, args.stride, args.min_valid]).encode()).hexdigest()[:12]
    path = os.path.join(args.cache, f"tiles_{key}.json")
    if not os.path.exists(path):
        os.makedirs(args.cache, exist_ok=True)
        t0 = time.time()
        index = build_index(scenes, args.tile, args.stride, args.min_valid)
        mean, std = band_statistics(scenes)
        with open(path, "w") as f:
            json.dump({"scenes": scenes, "index": index, "mean": mean, "std": std}, f)
        print(f"built tile cache {path}: {len(index)} tiles in {time.time() - t0:.0f}s", flush=True)
    with open(path) as f:
        return json.load(f)


class SceneTiles(Dataset):
    def __init__(self, scenes, index, mean, std, tile, augment):
        self.scenes, self.index, self.tile, self.augment = scenes, index, tile, augment
        self.mean = np.asarray(mean, np.float32)[:, None, None]
        self.std = np.asarray(std, np.float32)[:, None, None]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        s_id, y, x = self.index[i]
        win = Window(x, y, self.tile, self.tile)
        scene = self.scenes[s_id]
        with rasterio.open(scene) as src:
            img = src.read(window=win).astype(np.float32)
        with rasterio.open(label_path(scene)) as src:
            lbl = src.read(1, window=win).astype(np.int64)
        img = (img - self.mean) / self.std
        if self.augment and np.random.rand() < 0.5:
            img, lbl = img[:, ::-1], lbl[::-1]
        if self.augment and np.random.rand() < 0.5:
            img, lbl = img[:, :, ::-1], lbl[:, ::-1]
        return torch.from_numpy(img.copy()), torch.from_numpy(lbl.copy())


class SegNet(nn.Module):
    def __init__(self, in_chans, num_classes):
        super().__init__()
        self.backbone = timm.create_model("convnext_tiny", pretrained=False, features_only=True,
                                          in_chans=in_chans, out_indices=(0, 1, 2, 3))
        chs = self.backbone.feature_info.channels()
        self.lateral = nn.ModuleList([nn.Conv2d(c, 128, 1) for c in chs])
        self.fuse = nn.Sequential(nn.Conv2d(128 * 4, 256, 3, padding=1), nn.GroupNorm(32, 256),
                                  nn.GELU(), nn.Conv2d(256, num_classes, 1))

    def forward(self, x):
        feats = self.backbone(x)
        size = feats[0].shape[-2:]
        up = [F.interpolate(l(f), size=size, mode="bilinear", align_corners=False)
              for l, f in zip(self.lateral, feats)]
        out = self.fuse(torch.cat(up, 1))
        return F.interpolate(out, size=x.shape[-2:], mode="bilinear", align_corners=False)


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    scenes = sorted(args.scenes)
    cache = load_or_build_cache(args, scenes)
    index = cache["index"]
    # deterministic split by tile position so that every rank agrees
    rng = np.random.default_rng(42)
    order = rng.permutation(len(index))
    n_val = int(len(index) * args.val_fraction)
    val_idx = [index[i] for i in order[:n_val]]
    train_idx = [index[i] for i in order[n_val:]]

    train_ds = SceneTiles(scenes, train_idx, cache["mean"], cache["std"], args.tile, True)
    val_ds = SceneTiles(scenes, val_idx, cache["mean"], cache["std"], args.tile, False)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=False)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler,
                          num_workers=6, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.bs, sampler=val_sampler, num_workers=6)
    n_val_real = len(val_ds)

    in_chans = len(cache["mean"])
    model = DDP(SegNet(in_chans, NUM_CLASSES).to(dev), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * world, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_dl))
    crit = nn.CrossEntropyLoss(ignore_index=NODATA_LABEL)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for step, (img, lbl) in enumerate(train_dl):
            img, lbl = img.to(dev, non_blocking=True), lbl.to(dev, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = crit(model(img), lbl)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and step % 100 == 0:
                print(f"ep {epoch} step {step} loss {loss.item():.4f}", flush=True)

        # validation; padded duplicates from the sampler are dropped by position
        model.eval()
        cm = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.long, device=dev)
        seen = 0
        with torch.no_grad():
            for img, lbl in val_dl:
                keep = min(img.shape[0], max(0, (n_val_real - rank + world - 1) // world - seen))
                seen += img.shape[0]
                img, lbl = img[:keep].to(dev), lbl[:keep].to(dev)
                if keep == 0:
                    continue
                pred = model.module(img).argmax(1)
                m = lbl != NODATA_LABEL
                cm += torch.bincount(lbl[m] * NUM_CLASSES + pred[m],
                                     minlength=NUM_CLASSES ** 2).view(NUM_CLASSES, NUM_CLASSES)
        dist.all_reduce(cm)
        tp = cm.diag().double()
        iou = tp / (cm.sum(0) + cm.sum(1) - tp).double().clamp(min=1)
        miou = iou[1:].mean().item()
        if rank == 0:
            print(f"ep {epoch} val mIoU {miou:.4f} | " +
                  " ".join(f"{c}:{v:.3f}" for c, v in enumerate(iou.tolist()) if c > 0), flush=True)
            os.makedirs(args.ckpt_dir, exist_ok=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(),
                        "opt": opt.state_dict(), "mean": cache["mean"], "std": cache["std"]},
                       os.path.join(args.ckpt_dir, f"epoch_{epoch:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
