"""
COVID-19-20 lung lesion segmentation (CT), SegResNet, distributed data parallel.
Deterministic preprocessing is cached on the GPU to keep the random augmentation cheap.

torchrun --nproc_per_node=4 14_covid_lesion_gpu_transforms.py --data /data/COVID-19-20_v2/Train --out runs/covid_lesion
"""
import argparse
import glob
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import monai
from monai.data import CacheDataset, DataLoader, decollate_batch, partition_dataset
from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.metrics import DiceMetric
from monai.networks.nets import SegResNet
from monai.transforms import (AsDiscrete, Compose, CropForegroundd, EnsureChannelFirstd, EnsureTyped, LoadImaged,
                              Orientationd, RandAffined, RandCropByPosNegLabeld, RandFlipd, RandGaussianNoised,
                              ScaleIntensityRanged, Spacingd, SpatialPadd)

PATCH = (192, 192, 16)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/COVID-19-20_v2/Train")
    p.add_argument("--out", default="runs/covid_lesion")
    p.add_argument("--epochs", type=int, default=500)
    p.add_argument("--batch_size", type=int, default=2)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--val_frac", type=float, default=0.2)
    p.add_argument("--val_every", type=int, default=10)
    p.add_argument("--seed", type=int, default=2020)
    return p.parse_args()


def train_transforms(device, samples):
    keys = ("image", "label")
    return Compose([
        LoadImaged(keys),
        EnsureChannelFirstd(keys),
        Orientationd(keys, axcodes="LPS"),
        Spacingd(keys, pixdim=(1.25, 1.25, 5.0), mode=("bilinear", "nearest")),
        ScaleIntensityRanged("image", a_min=-1000.0, a_max=500.0, b_min=0.0, b_max=1.0, clip=True),
        CropForegroundd(keys, source_key="image"),
        SpatialPadd(keys, spatial_size=PATCH, mode="reflect"),
        EnsureTyped(keys, device=device, track_meta=False),
        RandAffined(keys, prob=0.15, rotate_range=(0.05, 0.05, None), scale_range=(0.1, 0.1, None),
                    mode=("bilinear", "nearest")),
        RandCropByPosNegLabeld(keys, label_key="label", spatial_size=PATCH, num_samples=samples, pos=1, neg=1),
        RandGaussianNoised("image", prob=0.15, std=0.01),
        RandFlipd(keys, spatial_axis=0, prob=0.5),
        RandFlipd(keys, spatial_axis=1, prob=0.5),
    ])


def val_transforms():
    keys = ("image", "label")
    return Compose([
        LoadImaged(keys),
        EnsureChannelFirstd(keys),
        Orientationd(keys, axcodes="LPS"),
        Spacingd(keys, pixdim=(1.25, 1.25, 5.0), mode=("bilinear", "nearest")),
        ScaleIntensityRanged("image", a_min=-1000.0, a_max=500.0, b_min=0.0, b_max=1.0, clip=True),
        CropForegroundd(keys, source_key="image"),
        EnsureTyped(keys, track_meta=False),
    ])


def main():
    args = get_args()
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(f"cuda:{local_rank}")
    torch.cuda.set_device(device)
    monai.utils.set_determinism(seed=args.seed)
    if rank == 0:
        monai.config.print_config()
        os.makedirs(args.out, exist_ok=True)

    images = sorted(glob.glob(os.path.join(args.data, "*_ct.nii.gz")))
    labels = sorted(glob.glob(os.path.join(args.data, "*_seg.nii.gz")))
    items = [{"image": i, "label": l} for i, l in zip(images, labels)]
    n_val = int(len(items) * args.val_frac)
    train_items, val_items = items[:-n_val], items[-n_val:]

    # each rank caches and trains on its own shard (same seed -> disjoint shards)
    train_shard = partition_dataset(train_items, num_partitions=world, shuffle=True, seed=args.seed,
                                    even_divisible=True)[rank]
    val_shard = partition_dataset(val_items, num_partitions=world, shuffle=False, even_divisible=False)[rank]

    train_ds = CacheDataset(train_shard, train_transforms(device, args.samples), cache_rate=1.0,
                            num_workers=args.workers)
    val_ds = CacheDataset(val_shard, val_transforms(), cache_rate=1.0, num_workers=args.workers)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=args.workers)
    val_loader = DataLoader(val_ds, batch_size=1, num_workers=2)

    model = SegResNet(spatial_dims=3, in_channels=1, out_channels=2, init_filters=16,
                      blocks_down=(1, 2, 2, 4), blocks_up=(1, 1, 1), norm="instance").to(device)
    model = DDP(model, device_ids=[local_rank])
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True, include_background=False)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    scaler = torch.cuda.amp.GradScaler()
    dice_metric = DiceMetric(include_background=False, reduction="mean")
    post_pred = AsDiscrete(argmax=True, to_onehot=2)
    post_label = AsDiscrete(to_onehot=2)

    best, best_ep = -1.0, -1
    for epoch in range(args.epochs):
        model.train()
        t0, total, steps = time.time(), 0.0, 0
        for batch in train_loader:
            x = batch["image"].to(device)
            y = batch["label"].to(device)
            optimizer.zero_grad(set_to_none=True)
            with torch.cuda.amp.autocast():
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            total += loss.item()
            steps += 1
        scheduler.step()
        if rank == 0:
            print(f"epoch {epoch} loss {total / steps:.4f} ({time.time() - t0:.1f}s)", flush=True)

        if (epoch + 1) % args.val_every == 0:
            model.eval()
            with torch.no_grad():
                for batch in val_loader:
                    x, y = batch["image"].to(device), batch["label"].to(device)
                    with torch.cuda.amp.autocast():
                        logits = sliding_window_inference(x, PATCH, 8, model.module, overlap=0.5, mode="gaussian")
                    dice_metric(y_pred=[post_pred(o) for o in decollate_batch(logits)],
                                y=[post_label(t) for t in decollate_batch(y)])
            metric = dice_metric.aggregate().item()
            dice_metric.reset()
            if rank == 0:
                if metric > best:
                    best, best_ep = metric, epoch
                    torch.save(model.module.state_dict(), os.path.join(args.out, "best_model.pt"))
                print(f"  val dice {metric:.4f} (best {best:.4f} @ {best_ep})", flush=True)
            dist.barrier()

    if rank == 0:
        np.savetxt(os.path.join(args.out, "best.txt"), np.array([best, best_ep]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
