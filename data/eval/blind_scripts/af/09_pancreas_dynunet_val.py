"""
MSD Task07 pancreas / tumour with DynUNet (nnU-Net topology), DDP training,
validation with Dice + HD95 on the held-out cases.

Run:
    torchrun --nproc_per_node=4 09_pancreas_dynunet_val.py --data_root /data/Task07_Pancreas \
        --datalist splits/pancreas_fold0.json --output runs/pancreas_f0
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from monai.data import CacheDataset, DataLoader, DistributedSampler, decollate_batch
from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.metrics import DiceMetric, HausdorffDistanceMetric
from monai.networks.nets import DynUNet
from monai.transforms import (AsDiscrete, Compose, CropForegroundd, EnsureChannelFirstd, EnsureTyped,
                              LoadImaged, Orientationd, RandCropByPosNegLabeld, RandFlipd, RandGaussianNoised,
                              RandRotated, RandZoomd, ScaleIntensityRanged, Spacingd, SpatialPadd)

PATCH = (224, 160, 64)
SPACING = (0.8, 0.8, 2.5)
KERNELS = [[3, 3, 1], [3, 3, 3], [3, 3, 3], [3, 3, 3], [3, 3, 3], [3, 3, 3]]
STRIDES = [[1, 1, 1], [2, 2, 1], [2, 2, 2], [2, 2, 2], [2, 2, 2], [2, 2, 1]]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_root", required=True)
    p.add_argument("--datalist", required=True)
    p.add_argument("--output", default="runs/pancreas")
    p.add_argument("--max_epochs", type=int, default=1000)
    p.add_argument("--val_interval", type=int, default=25)
    p.add_argument("--batch_size", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--num_workers", type=int, default=8)
    p.add_argument("--amp", type=int, default=1)
    return p.parse_args()


def get_data(args):
    with open(args.datalist) as f:
        dl = json.load(f)
    fix = lambda items: [{k: os.path.join(args.data_root, v) for k, v in d.items()} for d in items]
    keys = ["image", "label"]
    base = [
        LoadImaged(keys=keys),
        EnsureChannelFirstd(keys=keys),
        Orientationd(keys=keys, axcodes="RAS"),
        Spacingd(keys=keys, pixdim=SPACING, mode=("bilinear", "nearest")),
        ScaleIntensityRanged(keys="image", a_min=-96.0, a_max=215.0, b_min=0.0, b_max=1.0, clip=True),
        CropForegroundd(keys=keys, source_key="image"),
        EnsureTyped(keys=keys, track_meta=False),
    ]
    train_tf = Compose(base + [
        SpatialPadd(keys=keys, spatial_size=PATCH),
        RandCropByPosNegLabeld(keys=keys, label_key="label", spatial_size=PATCH, pos=2, neg=1, num_samples=2),
        RandZoomd(keys=keys, min_zoom=0.9, max_zoom=1.2, mode=("trilinear", "nearest"), align_corners=(True, None),
                  prob=0.15),
        RandRotated(keys=keys, range_x=0.26, range_y=0.26, range_z=0.26, mode=("bilinear", "nearest"), prob=0.15),
        RandGaussianNoised(keys="image", std=0.01, prob=0.15),
        RandFlipd(keys=keys, spatial_axis=[0], prob=0.5),
        RandFlipd(keys=keys, spatial_axis=[1], prob=0.5),
        RandFlipd(keys=keys, spatial_axis=[2], prob=0.5),
    ])
    val_tf = Compose(base)
    train_ds = CacheDataset(fix(dl["training"]), train_tf, cache_rate=1.0, num_workers=args.num_workers)
    val_ds = CacheDataset(fix(dl["validation"]), val_tf, cache_rate=1.0, num_workers=args.num_workers)
    return train_ds, val_ds


def main():
    args = get_args()
    dist.init_process_group(backend="nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)

    train_ds, val_ds = get_data(args)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=1, num_workers=2)

    model = DynUNet(spatial_dims=3, in_channels=1, out_channels=3, kernel_size=KERNELS, strides=STRIDES,
                    upsample_kernel_size=STRIDES[1:], norm_name="instance", deep_supervision=True,
                    deep_supr_num=3, res_block=True).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True, batch=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.99, weight_decay=3e-5, nesterov=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda ep: (1 - ep / args.max_epochs) ** 0.9)
    scaler = torch.cuda.amp.GradScaler(enabled=bool(args.amp))

    dice_metric = DiceMetric(include_background=False, reduction="mean_batch")
    hd_metric = HausdorffDistanceMetric(include_background=False, percentile=95, reduction="mean_batch")
    post_pred = AsDiscrete(argmax=True, to_onehot=3)
    post_label = AsDiscrete(to_onehot=3)
    ds_w = [1.0, 0.5, 0.25, 0.125]
    ds_w = [w / sum(ds_w) for w in ds_w]

    best_metric, best_epoch = -1.0, -1
    history = []
    for epoch in range(args.max_epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        start = time.time()
        epoch_loss = 0.0
        for step, batch in enumerate(train_loader, 1):
            images, labels = batch["image"].to(device), batch["label"].to(device)
            optimizer.zero_grad(set_to_none=True)
            with torch.cuda.amp.autocast(enabled=bool(args.amp)):
                out = model(images)  # (B, 1 + deep_supr_num, C, H, W, D)
                loss = sum(w * loss_fn(out[:, i], labels) for i, w in enumerate(ds_w))
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            epoch_loss += loss.item()
        scheduler.step()
        epoch_loss /= step
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.max_epochs} loss {epoch_loss:.4f} "
                  f"lr {scheduler.get_last_lr()[0]:.5f} {time.time() - start:.0f}s", flush=True)

        if rank == 0 and (epoch + 1) % args.val_interval == 0:
            net = model.module
            net.eval()
            with torch.no_grad():
                for batch in val_loader:
                    images, labels = batch["image"].to(device), batch["label"].to(device)
                    with torch.cuda.amp.autocast(enabled=bool(args.amp)):
                        logits = sliding_window_inference(images, PATCH, 2, net, overlap=0.5, mode="gaussian")
                    preds = [post_pred(x) for x in decollate_batch(logits)]
                    gts = [post_label(x) for x in decollate_batch(labels)]
                    dice_metric(y_pred=preds, y=gts)
                    hd_metric(y_pred=preds, y=gts)
                dice_pc = dice_metric.aggregate().cpu().numpy()
                hd_pc = hd_metric.aggregate().cpu().numpy()
                dice_metric.reset()
                hd_metric.reset()
            mean_dice = float(np.mean(dice_pc))
            history.append({"epoch": epoch + 1, "dice": dice_pc.tolist(), "hd95": hd_pc.tolist()})
            print(f"  val dice pancreas {dice_pc[0]:.4f} tumour {dice_pc[1]:.4f} | "
                  f"hd95 {hd_pc[0]:.2f} / {hd_pc[1]:.2f}", flush=True)
            if mean_dice > best_metric:
                best_metric, best_epoch = mean_dice, epoch + 1
                torch.save(net.state_dict(), os.path.join(args.output, "best_metric_model.pth"))
            torch.save({"epoch": epoch + 1, "model": net.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict()},
                       os.path.join(args.output, "latest.pth"))
            with open(os.path.join(args.output, "val_history.json"), "w") as f:
                json.dump(history, f, indent=2)
        dist.barrier()

    if rank == 0:
        print(f"done, best mean dice {best_metric:.4f} at epoch {best_epoch}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
