"""
Cloud / cloud-shadow segmentation on Sentinel-2 L2A scenes cut into 512px chips.

Chips are listed in a CSV (chip_id, scene_id, path, label_path). A train/val
split is drawn from that list; per-band percentile normalisation is applied
(2nd-98th percentile clip computed from a sample of training chips).

    torchrun --nnodes=1 --nproc_per_node=4 train_cloudseg.py --chips /data/s2cloud/chips.csv
"""
import argparse
import os
import random
import time

import numpy as np
import pandas as pd
import rasterio
import torch
import torch.nn as nn
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
import segmentation_models_pytorch as smp

BANDS = ["B02", "B03", "B04", "B05", "B06", "B07", "B08", "B8A", "B11", "B12"]
CLASSES = ["clear", "thick_cloud", "thin_cloud", "shadow"]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--chips", required=True)
    p.add_argument("--val-frac", type=float, default=0.1)
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--stat-samples", type=int, default=300)
    p.add_argument("--out", default="checkpoints/cloudseg")
    return p.parse_args()


def read_chip(path):
    with rasterio.open(path) as src:
        arr = src.read().astype(np.float32)  # (bands, H, W), L2A reflectance * 10000
    return arr


def band_percentiles(paths, lo=2, hi=98, pixels_per_chip=20000):
    samples = [[] for _ in BANDS]
    for p in paths:
        arr = read_chip(p)
        flat = arr.reshape(arr.shape[0], -1)
        idx = np.random.choice(flat.shape[1], size=min(pixels_per_chip, flat.shape[1]), replace=False)
        for b in range(len(BANDS)):
            v = flat[b, idx]
            samples[b].append(v[v > 0])
    p_lo = np.array([np.percentile(np.concatenate(s), lo) for s in samples], dtype=np.float32)
    p_hi = np.array([np.percentile(np.concatenate(s), hi) for s in samples], dtype=np.float32)
    return p_lo, p_hi


class CloudChips(Dataset):
    def __init__(self, df, p_lo, p_hi, augment):
        self.paths = df["path"].tolist()
        self.labels = df["label_path"].tolist()
        self.p_lo = p_lo[:, None, None]
        self.p_hi = p_hi[:, None, None]
        self.augment = augment

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        x = read_chip(self.paths[i])
        x = np.clip((x - self.p_lo) / (self.p_hi - self.p_lo), 0.0, 1.0)
        with rasterio.open(self.labels[i]) as src:
            y = src.read(1).astype(np.int64)
        if self.augment:
            if random.random() < 0.5:
                x, y = x[:, :, ::-1], y[:, ::-1]
            if random.random() < 0.5:
                x, y = x[:, ::-1, :], y[::-1, :]
        return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(y))


def seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    # different augmentation streams per process
    seed_all(args.seed + rank)

    df = pd.read_csv(args.chips)
    scenes = df["scene_id"].unique()
    np.random.shuffle(scenes)
    n_val = max(1, int(len(scenes) * args.val_frac))
    val_scenes = set(scenes[:n_val])
    train_df = df[~df["scene_id"].isin(val_scenes)].reset_index(drop=True)
    val_df = df[df["scene_id"].isin(val_scenes)].reset_index(drop=True)

    stat_paths = train_df["path"].sample(n=min(args.stat_samples, len(train_df)),
                                         random_state=args.seed).tolist()
    p_lo, p_hi = band_percentiles(stat_paths)
    p_lo_t = torch.from_numpy(p_lo).to(device)
    p_hi_t = torch.from_numpy(p_hi).to(device)
    dist.broadcast(p_lo_t, src=0)
    dist.broadcast(p_hi_t, src=0)
    p_lo, p_hi = p_lo_t.cpu().numpy(), p_hi_t.cpu().numpy()
    if rank == 0:
        print(f"{len(train_df)} train chips / {len(val_df)} val chips from {len(scenes)} scenes")
        os.makedirs(args.out, exist_ok=True)
        np.savez(os.path.join(args.out, "norm.npz"), p_lo=p_lo, p_hi=p_hi, bands=np.array(BANDS))

    train_ds = CloudChips(train_df, p_lo, p_hi, augment=True)
    val_ds = CloudChips(val_df, p_lo, p_hi, augment=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, args.batch_size, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    model = smp.Unet("resnet34", encoder_weights=None, in_channels=len(BANDS), classes=len(CLASSES))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_loader))
    class_w = torch.tensor([0.5, 1.0, 1.5, 2.0], device=device)
    criterion = nn.CrossEntropyLoss(weight=class_w)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()

        model.eval()
        conf = torch.zeros(len(CLASSES), len(CLASSES), dtype=torch.long, device=device)
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device), y.to(device)
                pred = model(x).argmax(1)
                conf += torch.bincount(y.flatten() * len(CLASSES) + pred.flatten(),
                                       minlength=len(CLASSES) ** 2).view(len(CLASSES), len(CLASSES))
        dist.all_reduce(conf)
        tp = conf.diag().float()
        iou = tp / (conf.sum(0) + conf.sum(1) - conf.diag()).float().clamp(min=1)
        miou = iou.mean().item()
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f} mIoU {miou:.4f} "
                  + " ".join(f"{c}={v:.3f}" for c, v in zip(CLASSES, iou.tolist()))
                  + f" ({time.time() - t0:.0f}s)", flush=True)
            if miou > best:
                best = miou
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
