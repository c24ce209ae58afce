"""
Fast multi-GPU spleen segmentation (MSD Task09) following the MONAI "fast training" recipe:
each rank caches only its own partition of the data, deterministic transforms are cached
on the GPU and random crops run in a ThreadDataLoader.

    torchrun --nproc_per_node=8 02_spleen_cachedataset_ddp.py -d /data/Task09_Spleen
"""
import argparse
import json
import os
import sys
import time
from glob import glob

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from monai.data import CacheDataset, ThreadDataLoader, decollate_batch, partition_dataset
from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.metrics import DiceMetric
from monai.networks.layers import Norm
from monai.networks.nets import UNet
from monai.optimizers import Novograd
from monai.transforms import (
    AsDiscrete,
    Compose,
    CropForegroundd,
    EnsureChannelFirstd,
    EnsureTyped,
    LoadImaged,
    Orientationd,
    RandCropByPosNegLabeld,
    RandFlipd,
    RandRotate90d,
    ScaleIntensityRanged,
    Spacingd,
)
from monai.utils import set_determinism
from torch.utils.tensorboard import SummaryWriter


def get_args():
    parser = argparse.ArgumentParser(description="spleen seg, DDP")
    parser.add_argument("-d", "--dir", default="/data/Task09_Spleen")
    parser.add_argument("--out", default="./out/spleen_unet")
    parser.add_argument("--epochs", type=int, default=600)
    parser.add_argument("--val_interval", type=int, default=10)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--num_samples", type=int, default=4, help="crops per volume")
    parser.add_argument("--resume", default="")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def transforms(device):
    common = [
        LoadImaged(keys=["image", "label"]),
        EnsureChannelFirstd(keys=["image", "label"]),
        Orientationd(keys=["image", "label"], axcodes="RAS"),
        Spacingd(keys=["image", "label"], pixdim=(1.5, 1.5, 2.0), mode=("bilinear", "nearest")),
        ScaleIntensityRanged(keys="image", a_min=-57, a_max=164, b_min=0.0, b_max=1.0, clip=True),
        CropForegroundd(keys=["image", "label"], source_key="image"),
        # move cached volumes to this rank's GPU, random transforms then run on device
        EnsureTyped(keys=["image", "label"], device=device, track_meta=False),
    ]
    train = Compose(common + [
        RandCropByPosNegLabeld(keys=["image", "label"], label_key="label", spatial_size=(96, 96, 96),
                               pos=1, neg=1, num_samples=4, image_key="image", image_threshold=0),
        RandFlipd(keys=["image", "label"], spatial_axis=[0], prob=0.1),
        RandFlipd(keys=["image", "label"], spatial_axis=[1], prob=0.1),
        RandFlipd(keys=["image", "label"], spatial_axis=[2], prob=0.1),
        RandRotate90d(keys=["image", "label"], prob=0.1, max_k=3),
    ])
    val = Compose(common)
    return train, val


def main():
    args = get_args()
    dist.init_process_group(backend="nccl", init_method="env://")
    local_rank = int(os.environ["LOCAL_RANK"])
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.cuda.set_device(device)
    set_determinism(seed=args.seed)

    images = sorted(glob(os.path.join(args.dir, "imagesTr", "*.nii.gz")))
    labels = sorted(glob(os.path.join(args.dir, "labelsTr", "*.nii.gz")))
    data = [{"image": i, "label": l} for i, l in zip(images, labels)]
    train_files, val_files = data[:-9], data[-9:]

    # same seed on every rank -> disjoint partitions, equal length for training
    train_part = partition_dataset(train_files, num_partitions=world, shuffle=True,
                                   seed=args.seed, even_divisible=True)[rank]
    val_part = partition_dataset(val_files, num_partitions=world, shuffle=False,
                                 even_divisible=False)[rank]

    train_tf, val_tf = transforms(device)
    train_ds = CacheDataset(train_part, transform=train_tf, cache_rate=1.0, num_workers=8, copy_cache=False)
    val_ds = CacheDataset(val_part, transform=val_tf, cache_rate=1.0, num_workers=4, copy_cache=False)
    # num_workers=0: data is already on the GPU, ThreadDataLoader just overlaps the random crops
    train_loader = ThreadDataLoader(train_ds, num_workers=0, batch_size=4, shuffle=True)
    val_loader = ThreadDataLoader(val_ds, num_workers=0, batch_size=1)

    model = UNet(spatial_dims=3, in_channels=1, out_channels=2, channels=(16, 32, 64, 128, 256),
                 strides=(2, 2, 2, 2), num_res_units=2, norm=Norm.INSTANCE).to(device)
    loss_function = DiceCELoss(to_onehot_y=True, softmax=True, squared_pred=True, batch=True)
    optimizer = Novograd(model.parameters(), lr=args.lr * world)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch, best_metric, best_metric_epoch = 0, -1.0, -1
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume, map_location=device)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_metric = ckpt["epoch"] + 1, ckpt["best_metric"]
    model = DistributedDataParallel(model, device_ids=[device])

    post_pred = Compose([AsDiscrete(argmax=True, to_onehot=2)])
    post_label = Compose([AsDiscrete(to_onehot=2)])
    dice_metric = DiceMetric(include_background=False, reduction="mean", get_not_nans=False)

    writer = SummaryWriter(log_dir=os.path.join(args.out, "tb")) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"[{time.strftime('%H:%M:%S')}] {len(train_files)} train / {len(val_files)} val, "
              f"{world} ranks, {len(train_part)} cases per rank", flush=True)

    for epoch in range(start_epoch, args.epochs):
        tic = time.time()
        model.train()
        epoch_loss, step = 0.0, 0
        for batch in train_loader:
            step += 1
            optimizer.zero_grad()
            with torch.cuda.amp.autocast():
                outputs = model(batch["image"])
                loss = loss_function(outputs, batch["label"])
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            epoch_loss += loss.item()
        epoch_loss /= step
        if rank == 0:
            writer.add_scalar("train/loss", epoch_loss, epoch)
            print(f"epoch {epoch + 1}/{args.epochs} rank0 loss {epoch_loss:.4f} "
                  f"time {time.time() - tic:.1f}s", flush=True)

        if (epoch + 1) % args.val_interval == 0:
            model.eval()
            with torch.no_grad():
                for val_data in val_loader:
                    with torch.cuda.amp.autocast():
                        val_outputs = sliding_window_inference(val_data["image"], (160, 160, 160), 4, model)
                    val_outputs = [post_pred(i) for i in decollate_batch(val_outputs)]
                    val_labels = [post_label(i) for i in decollate_batch(val_data["label"])]
                    dice_metric(y_pred=val_outputs, y=val_labels)
                # gathers the per-case results from all ranks
                metric = dice_metric.aggregate().item()
                dice_metric.reset()

            if rank == 0:
                writer.add_scalar("val/dice", metric, epoch)
                if metric > best_metric:
                    best_metric, best_metric_epoch = metric, epoch + 1
                    torch.save(model.module.state_dict(), os.path.join(args.out, "best_metric_model.pth"))
                torch.save({"epoch": epoch, "model": model.module.state_dict(),
                            "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
                            "best_metric": best_metric},
                           os.path.join(args.out, "checkpoint.pth"))
                print(f"  val dice {metric:.4f} best {best_metric:.4f} @ {best_metric_epoch}", flush=True)

    if rank == 0:
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump({"best_metric": best_metric, "best_epoch": best_metric_epoch}, f)
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.exit(0)
