#!/usr/bin/env python3
# Prostate zonal segmentation (MSD Task05: T2 + ADC -> PZ / TZ), multiprocessing-distributed.
# Single node:  python 06_prostate_spawn_unet.py --data /data/Task05_Prostate --multiprocessing-distributed
# Two nodes:    python 06_prostate_spawn_unet.py ... --world-size 2 --rank {0,1} --dist-url tcp://node01:23456
import argparse
import json
import os
import random
import shutil
import time
import warnings

import numpy as np
import torch
import torch.backends.cudnn as cudnn
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from monai.data import CacheDataset, DataLoader, DistributedSampler, decollate_batch
from monai.inferers import sliding_window_inference
from monai.losses import DiceFocalLoss
from monai.metrics import DiceMetric
from monai.networks.nets import UNet
from monai.transforms import (AsDiscrete, Compose, EnsureChannelFirstd, LoadImaged, NormalizeIntensityd,
                              Orientationd, RandAffined, RandCropByPosNegLabeld, RandFlipd, Spacingd,
                              SpatialPadd)

parser = argparse.ArgumentParser(description="MSD prostate")
parser.add_argument("--data", default="/data/Task05_Prostate")
parser.add_argument("--out", default="./checkpoints/prostate_unet")
parser.add_argument("--epochs", default=400, type=int)
parser.add_argument("-b", "--batch-size", default=8, type=int, help="total batch over all GPUs of a node")
parser.add_argument("--lr", default=3e-4, type=float)
parser.add_argument("-j", "--workers", default=8, type=int)
parser.add_argument("--val-freq", default=10, type=int)
parser.add_argument("--world-size", default=1, type=int, help="number of nodes")
parser.add_argument("--rank", default=0, type=int, help="node rank")
parser.add_argument("--dist-url", default="tcp://127.0.0.1:23456", type=str)
parser.add_argument("--dist-backend", default="nccl", type=str)
parser.add_argument("--seed", default=None, type=int)
parser.add_argument("--multiprocessing-distributed", action="store_true")

PATCH = (160, 160, 32)


def datalists(root):
    with open(os.path.join(root, "dataset.json")) as f:
        meta = json.load(f)
    items = [{"image": os.path.join(root, d["image"]), "label": os.path.join(root, d["label"])}
             for d in meta["training"]]
    return items[:26], items[26:]


def transforms():
    keys = ["image", "label"]
    base = [
        LoadImaged(keys=keys),
        EnsureChannelFirstd(keys=keys),
        Orientationd(keys=keys, axcodes="RAS"),
        Spacingd(keys=keys, pixdim=(0.625, 0.625, 3.6), mode=("bilinear", "nearest")),
        NormalizeIntensityd(keys="image", nonzero=True, channel_wise=True),
        SpatialPadd(keys=keys, spatial_size=PATCH),
    ]
    train = Compose(base + [
        RandCropByPosNegLabeld(keys=keys, label_key="label", spatial_size=PATCH, pos=2, neg=1, num_samples=2),
        RandAffined(keys=keys, prob=0.3, rotate_range=(0, 0, np.pi / 12), scale_range=(0.1, 0.1, 0.0),
                    mode=("bilinear", "nearest")),
        RandFlipd(keys=keys, prob=0.5, spatial_axis=0),
    ])
    return train, Compose(base)


def main():
    args = parser.parse_args()
    if args.seed is not None:
        random.seed(args.seed)
        torch.manual_seed(args.seed)
        cudnn.deterministic = True
        warnings.warn("deterministic cudnn is on, training will be slower")
    args.distributed = args.world_size > 1 or args.multiprocessing_distributed
    ngpus_per_node = torch.cuda.device_count()
    if args.multiprocessing_distributed:
        args.world_size = ngpus_per_node * args.world_size
        mp.spawn(main_worker, nprocs=ngpus_per_node, args=(args, ngpus_per_node))
    else:
        main_worker(0, ngpus_per_node, args)


def main_worker(gpu, ngpus_per_node, args):
    args.gpu = gpu
    if args.distributed:
        if args.multiprocessing_distributed:
            args.rank = args.rank * ngpus_per_node + gpu
        dist.init_process_group(backend=args.dist_backend, init_method=args.dist_url,
                                world_size=args.world_size, rank=args.rank)
    torch.cuda.set_device(args.gpu)
    is_main = not args.distributed or args.rank == 0

    model = UNet(spatial_dims=3, in_channels=2, out_channels=3, channels=(32, 64, 128, 256, 512),
                 strides=(2, 2, 2, (2, 2, 1)), num_res_units=2, norm="instance", dropout=0.1)
    model.cuda(args.gpu)
    if args.distributed:
        args.batch_size = args.batch_size // ngpus_per_node
        args.workers = (args.workers + ngpus_per_node - 1) // ngpus_per_node
        model = nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])

    criterion = DiceFocalLoss(to_onehot_y=True, softmax=True, gamma=2.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0=100)
    cudnn.benchmark = args.seed is None

    train_files, val_files = datalists(args.data)
    train_tf, val_tf = transforms()
    train_ds = CacheDataset(train_files, train_tf, cache_rate=1.0, num_workers=args.workers)
    val_ds = CacheDataset(val_files, val_tf, cache_rate=1.0, num_workers=args.workers)
    train_sampler = DistributedSampler(train_ds) if args.distributed else None
    val_sampler = DistributedSampler(val_ds, shuffle=False, even_divisible=False) if args.distributed else None
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=train_sampler is None,
                              sampler=train_sampler, num_workers=args.workers, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=1, sampler=val_sampler, num_workers=2)

    dice_metric = DiceMetric(include_background=False, reduction="mean_batch")
    post_pred = AsDiscrete(argmax=True, to_onehot=3)
    post_lbl = AsDiscrete(to_onehot=3)
    net = model.module if args.distributed else model

    best = 0.0
    if is_main:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        if args.distributed:
            train_sampler.set_epoch(epoch)
        model.train()
        tic, total, steps = time.time(), 0.0, 0
        for batch in train_loader:
            x = batch["image"].cuda(args.gpu, non_blocking=True)
            y = batch["label"].cuda(args.gpu, non_blocking=True)
            loss = criterion(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item()
            steps += 1
        scheduler.step()
        if is_main:
            print(f"[{epoch:03d}] train loss {total / max(steps, 1):.4f} ({time.time() - tic:.0f}s)", flush=True)

        if (epoch + 1) % args.val_freq == 0:
            net.eval()
            with torch.no_grad():
                for batch in val_loader:
                    x, y = batch["image"].cuda(args.gpu), batch["label"].cuda(args.gpu)
                    out = sliding_window_inference(x, PATCH, 4, net, overlap=0.25)
                    dice_metric(y_pred=[post_pred(o) for o in decollate_batch(out)],
                                y=[post_lbl(t) for t in decollate_batch(y)])
            pz, tz = dice_metric.aggregate().tolist()
            dice_metric.reset()
            mean = (pz + tz) / 2
            if is_main:
                print(f"[{epoch:03d}] val dice PZ {pz:.4f} TZ {tz:.4f} mean {mean:.4f}", flush=True)
                ckpt = {"epoch": epoch, "state_dict": net.state_dict(), "optimizer": optimizer.state_dict(),
                        "dice": mean}
                torch.save(ckpt, os.path.join(args.out, "checkpoint.pth.tar"))
                if mean > best:
                    best = mean
                    shutil.copyfile(os.path.join(args.out, "checkpoint.pth.tar"),
                                    os.path.join(args.out, "model_best.pth.tar"))

    if args.distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
