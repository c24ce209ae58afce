#!/usr/bin/env python
# AMOS22 (CT) 15-organ segmentation with SegResNetDS, DiceCE loss, DDP + AMP.
#
# Launch (8 x A100):
#   torchrun --nproc_per_node=8 --master_port=29533 12_amos_segresnet_launch.py \
#       --json /data/amos22/dataset.json --root /data/amos22 --out /mnt/exp/amos_segresnet
import argparse
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from monai.data import CacheDataset, DataLoader, DistributedSampler, decollate_batch, load_decathlon_datalist
from monai.inferers import SlidingWindowInfererAdapt
from monai.losses import DiceCELoss
from monai.metrics import DiceMetric
from monai.networks.nets import SegResNetDS
from monai.optimizers import WarmupCosineSchedule
from monai.transforms import (AsDiscrete, Compose, CropForegroundd, EnsureChannelFirstd, EnsureTyped, LoadImaged,
                              Orientationd, RandAffined, RandCropByLabelClassesd, RandFlipd, RandGaussianSmoothd,
                              RandScaleIntensityd, ScaleIntensityRanged, Spacingd, SpatialPadd)

NUM_CLASSES = 16
ROI = [192, 192, 128]


def parse_args():
    parser = argparse.ArgumentParser("AMOS SegResNet")
    parser.add_argument("--json", required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", default="./exp/amos_segresnet")
    parser.add_argument("--epochs", type=int, default=600)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--num_crops", type=int, default=2)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--val_every", type=int, default=10)
    parser.add_argument("--cache_rate", type=float, default=0.4)
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


def transforms(num_crops):
    keys = ["image", "label"]
    load = [
        LoadImaged(keys=keys, ensure_channel_first=False, image_only=True),
        EnsureChannelFirstd(keys=keys),
        EnsureTyped(keys=keys, data_type="tensor", dtype=(torch.float32, torch.uint8)),
        Orientationd(keys=keys, axcodes="RAS"),
        Spacingd(keys=keys, pixdim=(1.5, 1.5, 2.0), mode=("bilinear", "nearest")),
        ScaleIntensityRanged(keys="image", a_min=-991, a_max=362, b_min=0.0, b_max=1.0, clip=True),
        CropForegroundd(keys=keys, source_key="image", allow_smaller=True),
    ]
    train = Compose(load + [
        SpatialPadd(keys=keys, spatial_size=ROI),
        RandCropByLabelClassesd(keys=keys, label_key="label", spatial_size=ROI, num_classes=NUM_CLASSES,
                                num_samples=num_crops, warn=False),
        RandAffined(keys=keys, prob=0.2, rotate_range=[0.26] * 3, scale_range=[0.2] * 3,
                    mode=("bilinear", "nearest"), padding_mode="border"),
        RandGaussianSmoothd(keys="image", prob=0.2, sigma_x=(0.5, 1.0), sigma_y=(0.5, 1.0), sigma_z=(0.5, 1.0)),
        RandScaleIntensityd(keys="image", prob=0.5, factors=0.3),
        RandFlipd(keys=keys, prob=0.5, spatial_axis=0),
        RandFlipd(keys=keys, prob=0.5, spatial_axis=1),
        RandFlipd(keys=keys, prob=0.5, spatial_axis=2),
    ])
    return train, Compose(load)


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    torch.backends.cudnn.benchmark = True

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format="%(asctime)s - %(levelname)s - %(message)s")
    logger = logging.getLogger("amos")

    train_list = load_decathlon_datalist(args.json, True, "training", base_dir=args.root)
    val_list = load_decathlon_datalist(args.json, True, "validation", base_dir=args.root)
    train_tf, val_tf = transforms(args.num_crops)

    train_ds = CacheDataset(train_list, train_tf, cache_rate=args.cache_rate, num_workers=args.workers,
                            progress=rank == 0)
    val_ds = CacheDataset(val_list, val_tf, cache_rate=0.0, num_workers=args.workers)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, even_divisible=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=1, sampler=val_sampler, num_workers=2)

    model = SegResNetDS(spatial_dims=3, init_filters=32, in_channels=1, out_channels=NUM_CLASSES,
                        blocks_down=(1, 2, 2, 4, 4), norm="INSTANCE", dsdepth=1).to(device)
    model = DistributedDataParallel(model, device_ids=[args.local_rank], output_device=args.local_rank)

    loss_fn = DiceCELoss(include_background=True, to_onehot_y=True, softmax=True, batch=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
    steps_per_epoch = len(train_loader)
    scheduler = WarmupCosineSchedule(optimizer, warmup_steps=args.warmup * steps_per_epoch,
                                     t_total=args.epochs * steps_per_epoch)
    scaler = torch.cuda.amp.GradScaler()
    inferer = SlidingWindowInfererAdapt(roi_size=ROI, sw_batch_size=1, overlap=0.625, mode="gaussian",
                                        cache_roi_weight_map=True)
    dice_metric = DiceMetric(include_background=False, reduction="mean_batch", get_not_nans=False)
    post_pred = AsDiscrete(argmax=True, to_onehot=NUM_CLASSES)
    post_label = AsDiscrete(to_onehot=NUM_CLASSES)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        logger.info("train %d / val %d cases, %d GPUs, %d steps/epoch", len(train_list), len(val_list),
                    world_size, steps_per_epoch)

    best_dice = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_acc = torch.zeros(2, device=device)
        for batch in train_loader:
            img = batch["image"].to(device, non_blocking=True)
            lbl = batch["label"].to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.cuda.amp.autocast():
                logits = model(img)
                loss = loss_fn(logits, lbl)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            loss_acc += torch.tensor([loss.item(), 1.0], device=device)
        dist.all_reduce(loss_acc)
        logger.info("epoch %d loss %.4f lr %.2e %.0fs", epoch, (loss_acc[0] / loss_acc[1]).item(),
                    scheduler.get_last_lr()[0], time.time() - t0)

        if (epoch + 1) % args.val_every != 0:
            continue
        model.eval()
        with torch.no_grad(), torch.cuda.amp.autocast():
            for batch in val_loader:
                img, lbl = batch["image"].to(device), batch["label"].to(device)
                logits = inferer(img, model.module)
                dice_metric(y_pred=[post_pred(p) for p in decollate_batch(logits)],
                            y=[post_label(t) for t in decollate_batch(lbl)])
        per_organ = dice_metric.aggregate().cpu().numpy()
        dice_metric.reset()
        mean_dice = float(np.nanmean(per_organ))
        if rank == 0:
            logger.info("epoch %d val mean dice %.4f | %s", epoch, mean_dice, np.round(per_organ, 3).tolist())
            ckpt = {"epoch": epoch, "state_dict": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "best_dice": max(best_dice, mean_dice)}
            torch.save(ckpt, os.path.join(args.out, "model_last.pt"))
            if mean_dice > best_dice:
                torch.save(ckpt, os.path.join(args.out, "model_best.pt"))
                logger.info("new best %.4f -> %.4f", best_dice, mean_dice)
        best_dice = max(best_dice, mean_dice)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
