#!/usr/bin/env python
"""Liver / tumour segmentation with a MONAI 3D UNet, trained with DDP.

    torchrun --nproc_per_node=4 01_monai_unet_liver.py \
        --data_dir /datasets/Task03_Liver --fold 0 --out_dir runs/liver_f0
"""
import argparse
import json
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from sklearn.model_selection import KFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from monai.data import DataLoader, Dataset
from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.metrics import compute_dice
from monai.networks.layers import Norm
from monai.networks.nets import UNet
from monai.networks.utils import one_hot
from monai.transforms import (
    Compose,
    CropForegroundd,
    EnsureChannelFirstd,
    EnsureTyped,
    LoadImaged,
    Orientationd,
    RandCropByPosNegLabeld,
    RandFlipd,
    RandRotate90d,
    RandScaleIntensityd,
    RandShiftIntensityd,
    ScaleIntensityRanged,
    Spacingd,
)
from monai.utils import set_determinism

logger = logging.getLogger("liver")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", required=True)
    p.add_argument("--out_dir", default="runs/liver")
    p.add_argument("--fold", type=int, default=0, choices=range(5))
    p.add_argument("--epochs", type=int, default=500)
    p.add_argument("--batch_size", type=int, default=2, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--weight_decay", type=float, default=3e-5)
    p.add_argument("--patch", type=int, nargs=3, default=[128, 128, 128])
    p.add_argument("--num_classes", type=int, default=3)
    p.add_argument("--val_every", type=int, default=10)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--seed", type=int, default=12345)
    p.add_argument("--resume", default="")
    p.add_argument("--amp", action="store_true")
    return p.parse_args()


def get_split(data_dir, fold):
    with open(os.path.join(data_dir, "dataset.json")) as f:
        meta = json.load(f)
    items = sorted(meta["training"], key=lambda d: d["image"])
    items = [
        {"image": os.path.join(data_dir, d["image"]), "label": os.path.join(data_dir, d["label"])}
        for d in items
    ]
    kf = KFold(n_splits=5, shuffle=True, random_state=12345)
    tr_idx, va_idx = list(kf.split(items))[fold]
    return [items[i] for i in tr_idx], [items[i] for i in va_idx]


def get_transforms(patch):
    common = [
        LoadImaged(keys=["image", "label"]),
        EnsureChannelFirstd(keys=["image", "label"]),
        Orientationd(keys=["image", "label"], axcodes="RAS"),
        Spacingd(keys=["image", "label"], pixdim=(1.5, 1.5, 2.0), mode=("bilinear", "nearest")),
        ScaleIntensityRanged(keys="image", a_min=-175, a_max=250, b_min=0.0, b_max=1.0, clip=True),
        CropForegroundd(keys=["image", "label"], source_key="image"),
    ]
    train = Compose(
        common
        + [
            RandCropByPosNegLabeld(
                keys=["image", "label"], label_key="label", spatial_size=patch,
                pos=2, neg=1, num_samples=1, image_key="image", image_threshold=0,
            ),
            RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=0),
            RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=1),
            RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=2),
            RandRotate90d(keys=["image", "label"], prob=0.3, max_k=3),
            RandScaleIntensityd(keys="image", factors=0.1, prob=0.5),
            RandShiftIntensityd(keys="image", offsets=0.1, prob=0.5),
            EnsureTyped(keys=["image", "label"]),
        ]
    )
    val = Compose(common + [EnsureTyped(keys=["image", "label"])])
    return train, val


def build_model(num_classes):
    return UNet(
        spatial_dims=3,
        in_channels=1,
        out_channels=num_classes,
        channels=(32, 64, 128, 256, 320),
        strides=(2, 2, 2, 2),
        num_res_units=2,
        norm=Norm.BATCH,
        dropout=0.0,
    )


@torch.no_grad()
def validate(net, loader, args, device):
    net.eval()
    case_dice = []
    for batch in loader:
        img = batch["image"].to(device)
        lbl = batch["label"].to(device)
        with torch.autocast("cuda", enabled=args.amp):
            logits = sliding_window_inference(
                img, roi_size=args.patch, sw_batch_size=4, predictor=net,
                overlap=0.5, mode="gaussian",
            )
        pred = one_hot(logits.argmax(1, keepdim=True), args.num_classes)
        gt = one_hot(lbl.long(), args.num_classes)
        d = compute_dice(pred, gt, include_background=False, ignore_empty=True)
        case_dice.append(torch.nanmean(d, dim=0).cpu().numpy().tolist())
    return case_dice


def save_checkpoint(path, net, optimizer, scheduler, scaler, epoch, best):
    torch.save(
        {
            "model": net.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(),
            "epoch": epoch,
            "best_dice": best,
        },
        path,
    )


def main():
    args = parse_args()
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s [%(levelname)s] %(message)s",
    )
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
    set_determinism(seed=args.seed + rank)
    torch.backends.cudnn.benchmark = True

    train_files, val_files = get_split(args.data_dir, args.fold)
    train_tf, val_tf = get_transforms(args.patch)
    train_ds = Dataset(train_files, transform=train_tf)
    val_ds = Dataset(val_files[rank::world_size], transform=val_tf)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(
        train_ds, batch_size=args.batch_size, sampler=train_sampler,
        num_workers=args.workers, pin_memory=True, persistent_workers=True,
    )
    val_loader = DataLoader(val_ds, batch_size=1, num_workers=2)
    logger.info("fold %d: %d train / %d val cases, world size %d",
                args.fold, len(train_files), len(val_files), world_size)

    net = build_model(args.num_classes).to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.99,
                                nesterov=True, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda ep: (1 - ep / args.epochs) ** 0.9)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    start_epoch, best_dice = 0, -1.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        net.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_dice = ckpt["epoch"] + 1, ckpt["best_dice"]
        logger.info("resumed from %s at epoch %d", args.resume, start_epoch)

    model = DDP(net, device_ids=[local_rank], output_device=local_rank)
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True, batch=True,
                         smooth_nr=1e-5, smooth_dr=1e-5)

    for epoch in range(start_epoch, args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        running, steps = torch.zeros(1, device=device), 0
        for batch in train_loader:
            img = batch["image"].to(device, non_blocking=True)
            lbl = batch["label"].to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", enabled=args.amp):
                out = model(img)
                loss = loss_fn(out, lbl)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 12.0)
            scaler.step(optimizer)
            scaler.update()
            running += loss.detach()
            steps += 1
        scheduler.step()

        dist.all_reduce(running, op=dist.ReduceOp.SUM)
        mean_loss = running.item() / (steps * world_size)
        logger.info("epoch %d loss %.4f lr %.5f (%.1fs)", epoch, mean_loss,
                    optimizer.param_groups[0]["lr"], time.time() - t0)

        if (epoch + 1) % args.val_every == 0 or epoch + 1 == args.epochs:
            local = validate(model.module, val_loader, args, device)
            gathered = [None] * world_size
            dist.all_gather_object(gathered, local)
            if rank == 0:
                per_case = np.array([c for part in gathered for c in part])
                per_class = np.nanmean(per_case, axis=0)
                mean_dice = float(np.nanmean(per_class))
                logger.info("epoch %d val dice %s mean %.4f (%d cases)", epoch,
                            np.round(per_class, 4).tolist(), mean_dice, len(per_case))
                if mean_dice > best_dice:
                    best_dice = mean_dice
                    save_checkpoint(os.path.join(args.out_dir, "model_best.pt"), model.module,
                                    optimizer, scheduler, scaler, epoch, best_dice)

        if rank == 0:
            save_checkpoint(os.path.join(args.out_dir, "model_latest.pt"), model.module,
                            optimizer, scheduler, scaler, epoch, best_dice)
        dist.barrier()

    logger.info("finished, best mean dice %.4f", best_dice)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
