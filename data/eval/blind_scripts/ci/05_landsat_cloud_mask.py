"""Cloud / cloud-shadow masking for Landsat-8 OLI (L8 Biome-style labels).

Inputs are 512x512 patches of the 10 OLI/TIRS bands in TOA reflectance, written
as float32 GeoTIFFs together with a uint8 mask:
    0 fill, 1 clear, 2 cloud shadow, 3 thin cloud, 4 cloud

Classes are strongly imbalanced (shadow is <3% of pixels), so the loss uses
inverse-log-frequency weights computed from the training masks.

    torchrun --nproc_per_node=4 05_landsat_cloud_mask.py --root /nfs/l8biome/patches
"""
import argparse
import os
import random
from pathlib import Path

import numpy as np
import rasterio
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
import segmentation_models_pytorch as smp

CLASS_NAMES = ["clear", "shadow", "thin", "cloud"]
FILL = 0


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--out", type=Path, default=Path("/nfs/l8biome/runs/cloudmask"))
    p.add_argument("--arch", default="UnetPlusPlus")
    p.add_argument("--encoder", default="resnet34")
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--num-workers", type=int, default=6)
    return p.parse_args()


class BiomePatches(Dataset):
    def __init__(self, files, train):
        self.files = files
        self.train = train

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        img_path = self.files[i]
        with rasterio.open(img_path) as src:
            img = src.read().astype(np.float32)          # TOA reflectance 0..1(+)
        with rasterio.open(str(img_path).replace("_toa.tif", "_mask.tif")) as src:
            mask = src.read(1).astype(np.int64)
        img = np.clip(img, 0, 1.5)
        # shift labels so that fill becomes -100 (ignored) and classes start at 0
        target = np.where(mask == FILL, -100, mask - 1)
        if self.train:
            k = random.randint(0, 3)
            img, target = np.rot90(img, k, (1, 2)), np.rot90(target, k)
            if random.random() < 0.5:
                img, target = img[:, :, ::-1], target[:, ::-1]
        return torch.from_numpy(img.copy()), torch.from_numpy(target.copy())


def class_weights(files, n_classes=4, max_files=500):
    counts = np.zeros(n_classes, np.float64)
    for f in files[:max_files]:
        with rasterio.open(str(f).replace("_toa.tif", "_mask.tif")) as src:
            m = src.read(1, out_shape=(128, 128))
        counts += np.bincount(m[m != FILL].ravel() - 1, minlength=n_classes)[:n_classes]
    freq = counts / counts.sum()
    return 1.0 / np.log(1.02 + freq)


def confusion(pred, target, n):
    keep = target >= 0
    return torch.bincount(target[keep] * n + pred[keep], minlength=n * n).reshape(n, n)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)
    torch.manual_seed(0)

    train_files = sorted((args.root / "train").glob("*_toa.tif"))
    val_files = sorted((args.root / "val").glob("*_toa.tif"))
    train_ds = BiomePatches(train_files, train=True)
    val_ds = BiomePatches(val_files, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, drop_last=True,
                          num_workers=args.num_workers, pin_memory=True, persistent_workers=True)
    # contiguous, unpadded validation shards
    val_shard = torch.arange(len(val_ds)).tensor_split(world_size)[rank].tolist()
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, val_shard), args.batch_size,
                        num_workers=args.num_workers, pin_memory=True)

    model = getattr(smp, args.arch)(encoder_name=args.encoder, encoder_weights=None,
                                    in_channels=10, classes=len(CLASS_NAMES))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    w = class_weights(train_files)
    if rank == 0:
        print("class weights:", dict(zip(CLASS_NAMES, np.round(w, 3))), flush=True)
    criterion = nn.CrossEntropyLoss(weight=torch.tensor(w, dtype=torch.float32).cuda(),
                                    ignore_index=-100)
    dice = smp.losses.DiceLoss("multiclass", ignore_index=-100)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr * world_size, weight_decay=1e-2)
    warmup = len(train_dl)
    total = args.epochs * len(train_dl)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + np.cos(np.pi * s / total)))

    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
    best = 0.0
    n = len(CLASS_NAMES)
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for it, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            loss = criterion(logits, y) + 0.5 * dice(logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} it {it} loss {loss.item():.4f}", flush=True)

        model.eval()
        cm = torch.zeros(n, n, dtype=torch.long, device=device)
        with torch.no_grad():
            for x, y in val_dl:
                x, y = x.to(device), y.to(device)
                cm += confusion(model.module(x).argmax(1), y, n)
        dist.all_reduce(cm)
        tp = cm.diag().float()
        iou = tp / (cm.sum(0) + cm.sum(1) - cm.diag()).float().clamp(min=1)
        acc = (tp.sum() / cm.sum().clamp(min=1)).item()
        miou = iou.mean().item()
        if rank == 0:
            print(f"epoch {epoch}: OA {acc:.4f} mIoU {miou:.4f} "
                  + " ".join(f"{c}={v:.3f}" for c, v in zip(CLASS_NAMES, iou.tolist())), flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "miou": miou}, args.out / "last.pt")
            if miou > best:
                best = miou
                torch.save(model.module.state_dict(), args.out / "best_weights.pt")
        dist.barrier(device_ids=[local_rank])

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
