#!/usr/bin/env python
"""BraTS 2021 SegResNet training, one fold of 5-fold CV, multi-GPU with torchrun.

Usage:
    torchrun --nproc_per_node=4 01_kfold_brats_segresnet.py --data_dir /data/BraTS2021 --fold 0
"""
import argparse
import glob
import json
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from sklearn.model_selection import KFold
from torch.nn.parallel import DistributedDataParallel as DDP

from monai.data import CacheDataset, DataLoader, DistributedSampler, decollate_batch
from monai.inferers import sliding_window_inference
from monai.losses import DiceLoss
from monai.metrics import DiceMetric
from monai.networks.nets import SegResNet
from monai.transforms import (
    Activations,
    AsDiscrete,
    Compose,
    ConvertToMultiChannelBasedOnBratsClassesd,
    CropForegroundd,
    EnsureChannelFirstd,
    EnsureTyped,
    LoadImaged,
    NormalizeIntensityd,
    Orientationd,
    RandFlipd,
    RandScaleIntensityd,
    RandShiftIntensityd,
    RandSpatialCropd,
    Spacingd,
)
from monai.utils import set_determinism

logger = logging.getLogger("brats")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", default="/data/BraTS2021")
    p.add_argument("--out_dir", default="./runs/brats_segresnet")
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--n_folds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--val_every", type=int, default=5)
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--roi", type=int, nargs=3, default=[224, 224, 144])
    p.add_argument("--cache_rate", type=float, default=0.5)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--seed", type=int, default=12345)
    return p.parse_args()


def list_cases(data_dir):
    cases = []
    for case_dir in sorted(glob.glob(os.path.join(data_dir, "BraTS2021_*"))):
        cid = os.path.basename(case_dir)
        cases.append({
            "image": [os.path.join(case_dir, f"{cid}_{m}.nii.gz") for m in ("flair", "t1ce", "t1", "t2")],
            "label": os.path.join(case_dir, f"{cid}_seg.nii.gz"),
            "id": cid,
        })
    return cases


def get_transforms(roi):
    train_tf = Compose([
        LoadImaged(keys=["image", "label"]),
        EnsureChannelFirstd(keys="image"),
        EnsureTyped(keys=["image", "label"]),
        ConvertToMultiChannelBasedOnBratsClassesd(keys="label"),
        Orientationd(keys=["image", "label"], axcodes="RAS"),
        Spacingd(keys=["image", "label"], pixdim=(1.0, 1.0, 1.0), mode=("bilinear", "nearest")),
        CropForegroundd(keys=["image", "label"], source_key="image", k_divisible=roi),
        RandSpatialCropd(keys=["image", "label"], roi_size=roi, random_size=False),
        RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=0),
        RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=1),
        RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=2),
        NormalizeIntensityd(keys="image", nonzero=True, channel_wise=True),
        RandScaleIntensityd(keys="image", factors=0.1, prob=1.0),
        RandShiftIntensityd(keys="image", offsets=0.1, prob=1.0),
    ])
    val_tf = Compose([
        LoadImaged(keys=["image", "label"]),
        EnsureChannelFirstd(keys="image"),
        EnsureTyped(keys=["image", "label"]),
        ConvertToMultiChannelBasedOnBratsClassesd(keys="label"),
        Orientationd(keys=["image", "label"], axcodes="RAS"),
        Spacingd(keys=["image", "label"], pixdim=(1.0, 1.0, 1.0), mode=("bilinear", "nearest")),
        NormalizeIntensityd(keys="image", nonzero=True, channel_wise=True),
    ])
    return train_tf, val_tf


def main():
    args = parse_args()
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [%(levelname)s] %(message)s")
    set_determinism(seed=args.seed + rank)

    fold_dir = os.path.join(args.out_dir, f"fold{args.fold}")
    if rank == 0:
        os.makedirs(fold_dir, exist_ok=True)

    cases = list_cases(args.data_dir)
    kf = KFold(n_splits=args.n_folds, shuffle=True)
    train_idx, val_idx = list(kf.split(cases))[args.fold]
    train_files = [cases[i] for i in train_idx]
    val_files = [cases[i] for i in val_idx]
    logger.info("fold %d: %d train / %d val cases, world size %d",
                args.fold, len(train_files), len(val_files), world_size)
    if rank == 0:
        with open(os.path.join(fold_dir, "split.json"), "w") as f:
            json.dump({"train": [c["id"] for c in train_files], "val": [c["id"] for c in val_files]}, f, indent=1)

    train_tf, val_tf = get_transforms(args.roi)
    train_ds = CacheDataset(train_files, transform=train_tf, cache_rate=args.cache_rate, num_workers=args.workers)
    val_ds = CacheDataset(val_files, transform=val_tf, cache_rate=1.0, num_workers=args.workers)

    train_sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, even_divisible=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=1, sampler=val_sampler, num_workers=args.workers)

    model = SegResNet(blocks_down=[1, 2, 2, 4], blocks_up=[1, 1, 1], init_filters=16,
                      in_channels=4, out_channels=3, dropout_prob=0.2).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    loss_fn = DiceLoss(smooth_nr=0, smooth_dr=1e-5, squared_pred=True, to_onehot_y=False, sigmoid=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    dice_metric = DiceMetric(include_background=True, reduction="mean")
    dice_metric_batch = DiceMetric(include_background=True, reduction="mean_batch")
    post_pred = Compose([Activations(sigmoid=True), AsDiscrete(threshold=0.5)])

    best_dice, best_epoch = -1.0, -1
    for epoch in range(args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        epoch_loss = torch.zeros(2, device=device)
        for batch in train_loader:
            img = batch["image"].to(device, non_blocking=True)
            lbl = batch["label"].to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.cuda.amp.autocast(enabled=args.amp):
                loss = loss_fn(model(img), lbl)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            epoch_loss[0] += loss.detach()
            epoch_loss[1] += 1
        scheduler.step()
        dist.all_reduce(epoch_loss, op=dist.ReduceOp.SUM)
        logger.info("epoch %d loss %.4f lr %.2e (%.1fs)", epoch, (epoch_loss[0] / epoch_loss[1]).item(),
                    scheduler.get_last_lr()[0], time.time() - t0)

        if (epoch + 1) % args.val_every != 0:
            continue

        model.eval()
        with torch.no_grad():
            for batch in val_loader:
                img = batch["image"].to(device)
                lbl = batch["label"].to(device)
                with torch.cuda.amp.autocast(enabled=args.amp):
                    logits = sliding_window_inference(img, roi_size=args.roi, sw_batch_size=4,
                                                      predictor=model.module, overlap=0.5)
                preds = [post_pred(p) for p in decollate_batch(logits)]
                dice_metric(y_pred=preds, y=lbl)
                dice_metric_batch(y_pred=preds, y=lbl)
        mean_dice = dice_metric.aggregate().item()
        per_class = dice_metric_batch.aggregate().cpu().numpy()
        dice_metric.reset()
        dice_metric_batch.reset()

        if rank == 0:
            logger.info("epoch %d val dice %.4f (TC %.4f WT %.4f ET %.4f)", epoch, mean_dice, *per_class)
            if mean_dice > best_dice:
                best_dice, best_epoch = mean_dice, epoch
                torch.save({"epoch": epoch, "model": model.module.state_dict(),
                            "optimizer": optimizer.state_dict(), "best_dice": best_dice},
                           os.path.join(fold_dir, "best_model.pt"))
            torch.save({"epoch": epoch, "model": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                        "scaler": scaler.state_dict()},
                       os.path.join(fold_dir, "last_model.pt"))
        dist.barrier()

    if rank == 0:
        logger.info("fold %d done: best dice %.4f at epoch %d", args.fold, best_dice, best_epoch)
        with open(os.path.join(fold_dir, "result.json"), "w") as f:
            json.dump({"fold": args.fold, "best_dice": best_dice, "best_epoch": best_epoch}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
