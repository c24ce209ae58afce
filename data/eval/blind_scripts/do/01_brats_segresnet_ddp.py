#!/usr/bin/env python
"""BraTS 2021 glioma sub-region segmentation (TC / WT / ET) with SegResNet.

Multi-GPU training with DistributedDataParallel, launched with torchrun.
Data list is the usual json produced by our prep script (one entry per case,
four MRI modalities + seg).
"""
import argparse
import json
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from monai.data import CacheDataset, DataLoader, Dataset, decollate_batch, partition_dataset
from monai.inferers import sliding_window_inference
from monai.losses import DiceLoss
from monai.metrics import DiceMetric
from monai.networks.nets import SegResNet
from monai.transforms import (
    Activations,
    AsDiscrete,
    Compose,
    ConvertToMultiChannelBasedOnBratsClassesd,
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
    p.add_argument("--datalist", default="/data/brats2021/brats21_folds.json")
    p.add_argument("--data_root", default="/data/brats2021/TrainingData")
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--out_dir", default="./runs/brats_segresnet")
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--roi", type=int, nargs=3, default=[96, 96, 96])
    p.add_argument("--val_every", type=int, default=10)
    p.add_argument("--cache_rate", type=float, default=0.5)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--seed", type=int, default=12345)
    return p.parse_args()


def load_fold(datalist, data_root, fold):
    with open(datalist) as f:
        entries = json.load(f)["training"]
    train, val = [], []
    for e in entries:
        item = {
            "image": [os.path.join(data_root, x) for x in e["image"]],
            "label": os.path.join(data_root, e["label"]),
        }
        (val if e["fold"] == fold else train).append(item)
    return train, val


def get_transforms(roi):
    train_tf = Compose([
        LoadImaged(keys=["image", "label"]),
        EnsureChannelFirstd(keys="image"),
        EnsureTyped(keys=["image", "label"]),
        ConvertToMultiChannelBasedOnBratsClassesd(keys="label"),
        Orientationd(keys=["image", "label"], axcodes="RAS"),
        Spacingd(keys=["image", "label"], pixdim=(1.0, 1.0, 1.0), mode=("bilinear", "nearest")),
        NormalizeIntensityd(keys="image", nonzero=True, channel_wise=True),
        RandSpatialCropd(keys=["image", "label"], roi_size=roi, random_size=False),
        RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=0),
        RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=1),
        RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=2),
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
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s [%(levelname)s] %(message)s",
    )
    set_determinism(seed=args.seed)

    train_files, val_files = load_fold(args.datalist, args.data_root, args.fold)
    train_tf, val_tf = get_transforms(tuple(args.roi))

    # each rank only caches its own share of the training cases
    train_part = partition_dataset(train_files, num_partitions=world_size, shuffle=True,
                                   seed=args.seed, even_divisible=True)[rank]
    val_part = partition_dataset(val_files, num_partitions=world_size, shuffle=False,
                                 even_divisible=False)[rank]

    train_ds = CacheDataset(train_part, transform=train_tf, cache_rate=args.cache_rate,
                            num_workers=args.workers)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True,
                              num_workers=args.workers, pin_memory=True)
    val_ds = Dataset(val_part, transform=val_tf)
    val_loader = DataLoader(val_ds, batch_size=1, num_workers=2)

    model = SegResNet(
        blocks_down=[1, 2, 2, 4],
        blocks_up=[1, 1, 1],
        init_filters=16,
        in_channels=4,
        out_channels=3,
        dropout_prob=0.2,
    ).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    loss_fn = DiceLoss(smooth_nr=0, smooth_dr=1e-5, squared_pred=True, to_onehot_y=False, sigmoid=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    dice_metric = DiceMetric(include_background=True, reduction="mean_batch")
    post_trans = Compose([Activations(sigmoid=True), AsDiscrete(threshold=0.5)])

    writer = None
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        writer = SummaryWriter(log_dir=os.path.join(args.out_dir, "tb"))

    best_metric, best_epoch = -1.0, -1
    global_step = 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        epoch_loss, n_steps = 0.0, 0
        for batch in train_loader:
            images = batch["image"].to(device, non_blocking=True)
            labels = batch["label"].to(device, non_blocking=True)
            # random crops that miss the tumour entirely give no useful Dice signal
            if labels.sum() == 0:
                continue
            optimizer.zero_grad(set_to_none=True)
            with torch.cuda.amp.autocast(enabled=args.amp):
                logits = model(images)
                loss = loss_fn(logits, labels)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            epoch_loss += loss.item()
            n_steps += 1
            global_step += 1
        scheduler.step()

        stats = torch.tensor([epoch_loss, n_steps], dtype=torch.float64, device=device)
        dist.all_reduce(stats, op=dist.ReduceOp.SUM)
        mean_loss = (stats[0] / stats[1].clamp(min=1)).item()
        logger.info("epoch %d/%d loss %.4f (%.1fs)", epoch + 1, args.epochs, mean_loss, time.time() - t0)
        if writer is not None:
            writer.add_scalar("train/loss", mean_loss, epoch + 1)
            writer.add_scalar("train/lr", scheduler.get_last_lr()[0], epoch + 1)

        if (epoch + 1) % args.val_every == 0:
            model.eval()
            with torch.no_grad():
                for batch in val_loader:
                    images = batch["image"].to(device)
                    labels = batch["label"].to(device)
                    with torch.cuda.amp.autocast(enabled=args.amp):
                        outputs = sliding_window_inference(images, tuple(args.roi), 4, model.module,
                                                           overlap=0.5)
                    outputs = [post_trans(o) for o in decollate_batch(outputs)]
                    dice_metric(y_pred=outputs, y=decollate_batch(labels))
            # aggregate() gathers the buffers from every rank
            per_class = dice_metric.aggregate()
            dice_metric.reset()
            mean_dice = per_class.mean().item()
            if rank == 0:
                tc, wt, et = per_class.tolist()
                logger.info("val dice %.4f  TC %.4f WT %.4f ET %.4f", mean_dice, tc, wt, et)
                writer.add_scalar("val/mean_dice", mean_dice, epoch + 1)
                writer.add_scalar("val/dice_tc", tc, epoch + 1)
                writer.add_scalar("val/dice_wt", wt, epoch + 1)
                writer.add_scalar("val/dice_et", et, epoch + 1)
                if mean_dice > best_metric:
                    best_metric, best_epoch = mean_dice, epoch + 1
                    torch.save(model.module.state_dict(),
                               os.path.join(args.out_dir, f"best_fold{args.fold}.pt"))
                torch.save({
                    "epoch": epoch + 1,
                    "model": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "scaler": scaler.state_dict(),
                    "best_metric": best_metric,
                }, os.path.join(args.out_dir, f"last_fold{args.fold}.pt"))
            dist.barrier()

    if rank == 0:
        logger.info("finished: best mean dice %.4f at epoch %d", best_metric, best_epoch)
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
