"""Liver + tumour segmentation (MSD Task03 / LiTS) with an nnU-Net-like DynUNet.

torchrun --nproc_per_node=4 03_liver_dynunet_resume.py --fold 0 [--resume runs/liver/fold0/latest.pt]
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data.distributed import DistributedSampler

from monai.data import CacheDataset, DataLoader, Dataset, decollate_batch, partition_dataset
from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.metrics import DiceMetric
from monai.networks.nets import DynUNet
from monai.transforms import (
    AsDiscrete,
    Compose,
    CropForegroundd,
    EnsureChannelFirstd,
    EnsureTyped,
    LoadImaged,
    NormalizeIntensityd,
    Orientationd,
    RandCropByPosNegLabeld,
    RandFlipd,
    RandGaussianNoised,
    RandScaleIntensityd,
    RandZoomd,
    ScaleIntensityRanged,
    Spacingd,
    SpatialPadd,
)

PATCH = (128, 128, 128)
SPACING = (1.0, 0.77, 0.77)
KERNELS = [[3, 3, 3]] * 6
STRIDES = [[1, 1, 1], [2, 2, 2], [2, 2, 2], [2, 2, 2], [2, 2, 2], [2, 2, 2]]


def get_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="/mnt/nas/seg/Task03_Liver")
    parser.add_argument("--splits", default="/mnt/nas/seg/Task03_Liver/splits_final.json")
    parser.add_argument("--fold", type=int, default=0)
    parser.add_argument("--out", default="runs/liver")
    parser.add_argument("--epochs", type=int, default=500)
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--val_every", type=int, default=50)
    parser.add_argument("--resume", type=str, default=None)
    parser.add_argument("--amp", action="store_true", default=True)
    return parser


def transforms():
    load = [
        LoadImaged(keys=["image", "label"]),
        EnsureChannelFirstd(keys=["image", "label"]),
        Orientationd(keys=["image", "label"], axcodes="RAS"),
        Spacingd(keys=["image", "label"], pixdim=SPACING, mode=("bilinear", "nearest")),
        ScaleIntensityRanged(keys="image", a_min=-17, a_max=201, b_min=-17, b_max=201, clip=True),
        NormalizeIntensityd(keys="image", subtrahend=99.4, divisor=39.4),
        CropForegroundd(keys=["image", "label"], source_key="image"),
    ]
    train = load + [
        SpatialPadd(keys=["image", "label"], spatial_size=PATCH),
        RandCropByPosNegLabeld(keys=["image", "label"], label_key="label", spatial_size=PATCH,
                               pos=1, neg=2, num_samples=1, image_key="image", image_threshold=0),
        RandZoomd(keys=["image", "label"], min_zoom=0.9, max_zoom=1.2, mode=("trilinear", "nearest"),
                  align_corners=(True, None), prob=0.15),
        RandGaussianNoised(keys="image", std=0.01, prob=0.15),
        RandScaleIntensityd(keys="image", factors=0.3, prob=0.15),
        RandFlipd(keys=["image", "label"], spatial_axis=[0], prob=0.5),
        RandFlipd(keys=["image", "label"], spatial_axis=[1], prob=0.5),
        RandFlipd(keys=["image", "label"], spatial_axis=[2], prob=0.5),
        EnsureTyped(keys=["image", "label"]),
    ]
    val = load + [EnsureTyped(keys=["image", "label"])]
    return Compose(train), Compose(val)


def poly_lr(epoch, max_epochs, base_lr, exponent=0.9):
    return base_lr * (1 - epoch / max_epochs) ** exponent


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    out_dir = os.path.join(args.out, f"fold{args.fold}")

    with open(args.splits) as f:
        split = json.load(f)[args.fold]
    to_item = lambda c: {"image": f"{args.root}/imagesTr/{c}.nii.gz", "label": f"{args.root}/labelsTr/{c}.nii.gz"}
    train_files = [to_item(c) for c in split["train"]]
    val_files = [to_item(c) for c in split["val"]]

    train_tf, val_tf = transforms()
    train_ds = CacheDataset(train_files, train_tf, cache_rate=1.0, num_workers=8, copy_cache=False)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                              pin_memory=True, persistent_workers=True)
    val_ds = Dataset(partition_dataset(val_files, num_partitions=world, even_divisible=False)[rank], val_tf)
    val_loader = DataLoader(val_ds, batch_size=1, num_workers=2)

    net = DynUNet(
        spatial_dims=3, in_channels=1, out_channels=3,
        kernel_size=KERNELS, strides=STRIDES, upsample_kernel_size=STRIDES[1:],
        norm_name=("INSTANCE", {"affine": True}), deep_supervision=True, deep_supr_num=2,
        res_block=True,
    ).to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.99, nesterov=True, weight_decay=3e-5)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    start_epoch, best_dice = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume)
        net.load_state_dict(ckpt["net"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"] + 1
        best_dice = ckpt["best_dice"]

    model = DistributedDataParallel(net, device_ids=[local_rank])
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True, batch=True)
    dice_metric = DiceMetric(include_background=False, reduction="mean_batch")
    post_pred = AsDiscrete(argmax=True, to_onehot=3)
    post_label = AsDiscrete(to_onehot=3)
    ds_weights = [1.0, 0.5, 0.25]

    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        print(f"fold {args.fold}: {len(train_files)} train / {len(val_files)} val, world size {world}")

    for epoch in range(start_epoch, args.epochs):
        for g in optimizer.param_groups:
            g["lr"] = poly_lr(epoch, args.epochs, args.lr)
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        loss_sum = torch.zeros((), device=device)
        it = 0
        for batch in train_loader:
            img = batch["image"].to(device, non_blocking=True)
            seg = batch["label"].to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                preds = torch.unbind(model(img), dim=1)
                loss = sum(w * loss_fn(p, seg) for w, p in zip(ds_weights, preds)) / sum(ds_weights)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 12)
            scaler.step(optimizer)
            scaler.update()
            loss_sum += loss.detach()
            it += 1
        dist.all_reduce(loss_sum)
        if rank == 0:
            print(f"[{epoch:04d}] loss {loss_sum.item() / (it * world):.4f} "
                  f"lr {optimizer.param_groups[0]['lr']:.5f} {time.time() - tic:.0f}s", flush=True)

        if (epoch + 1) % args.val_every == 0 or epoch + 1 == args.epochs:
            model.eval()
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                for batch in val_loader:
                    img = batch["image"].to(device)
                    seg = batch["label"].to(device)
                    logits = sliding_window_inference(img, PATCH, 2, net, overlap=0.5, mode="gaussian")
                    dice_metric(y_pred=[post_pred(x) for x in decollate_batch(logits)],
                                y=[post_label(x) for x in decollate_batch(seg)])
            liver_dice, tumour_dice = dice_metric.aggregate().tolist()
            dice_metric.reset()
            mean_dice = (liver_dice + tumour_dice) / 2
            is_best = mean_dice > best_dice
            best_dice = max(best_dice, mean_dice)
            if rank == 0:
                print(f"  val liver {liver_dice:.4f} tumour {tumour_dice:.4f} mean {mean_dice:.4f}", flush=True)
                state = {"net": net.state_dict(), "optimizer": optimizer.state_dict(),
                         "scaler": scaler.state_dict(), "epoch": epoch, "best_dice": best_dice}
                torch.save(state, os.path.join(out_dir, "latest.pt"))
                if is_best:
                    torch.save(state, os.path.join(out_dir, "best.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
