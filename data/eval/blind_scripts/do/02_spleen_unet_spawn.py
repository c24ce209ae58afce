"""Spleen CT segmentation (MSD Task09) - 3D UNet, multi-GPU via mp.spawn.

Usage:
    python 02_spleen_unet_spawn.py --data_dir /data/MSD/Task09_Spleen --gpus 4
"""
import argparse
import contextlib
import glob
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from monai.data import CacheDataset, DataLoader, Dataset, decollate_batch, partition_dataset
from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.metrics import DiceMetric
from monai.networks.layers import Norm
from monai.networks.nets import UNet
from monai.transforms import (
    AsDiscrete,
    Compose,
    CropForegroundd,
    EnsureChannelFirstd,
    EnsureTyped,
    LoadImaged,
    Orientationd,
    RandCropByPosNegLabeld,
    RandRotate90d,
    ScaleIntensityRanged,
    Spacingd,
)
from monai.utils import set_determinism


def get_args():
    parser = argparse.ArgumentParser(description="Spleen 3D UNet")
    parser.add_argument("--data_dir", default="/data/MSD/Task09_Spleen")
    parser.add_argument("--out", default="./checkpoints/spleen")
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    parser.add_argument("--epochs", type=int, default=600)
    parser.add_argument("--batch_size", type=int, default=2, help="volumes per GPU")
    parser.add_argument("--num_samples", type=int, default=4, help="patches per volume")
    parser.add_argument("--accum", type=int, default=2, help="gradient accumulation steps")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--val_interval", type=int, default=5)
    parser.add_argument("--resume", default="")
    parser.add_argument("--port", type=int, default=0)
    return parser.parse_args()


def free_port():
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def build_transforms(num_samples):
    common = [
        LoadImaged(keys=["image", "label"]),
        EnsureChannelFirstd(keys=["image", "label"]),
        Orientationd(keys=["image", "label"], axcodes="RAS"),
        Spacingd(keys=["image", "label"], pixdim=(1.5, 1.5, 2.0), mode=("bilinear", "nearest")),
        ScaleIntensityRanged(keys="image", a_min=-57, a_max=164, b_min=0.0, b_max=1.0, clip=True),
        CropForegroundd(keys=["image", "label"], source_key="image"),
        EnsureTyped(keys=["image", "label"]),
    ]
    train = Compose(common + [
        RandCropByPosNegLabeld(keys=["image", "label"], label_key="label", spatial_size=(96, 96, 96),
                               pos=1, neg=1, num_samples=num_samples, image_key="image", image_threshold=0),
        RandRotate90d(keys=["image", "label"], prob=0.2, spatial_axes=(0, 2)),
    ])
    val = Compose(common)
    return train, val


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    device = torch.device(f"cuda:{rank}")
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}",
                            world_size=world_size, rank=rank, timeout=timedelta(minutes=60))
    set_determinism(seed=0)

    images = sorted(glob.glob(os.path.join(args.data_dir, "imagesTr", "*.nii.gz")))
    labels = sorted(glob.glob(os.path.join(args.data_dir, "labelsTr", "*.nii.gz")))
    files = [{"image": i, "label": l} for i, l in zip(images, labels)]
    train_files, val_files = files[:-9], files[-9:]

    train_tf, val_tf = build_transforms(args.num_samples)
    train_ds = CacheDataset(train_files, transform=train_tf, cache_rate=1.0, num_workers=4)
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True)

    # 9 val cases do not split evenly; keep every case exactly once
    val_part = partition_dataset(val_files, num_partitions=world_size, shuffle=False,
                                 even_divisible=False)[rank]
    val_loader = DataLoader(Dataset(val_part, transform=val_tf), batch_size=1, num_workers=2)

    net = UNet(
        spatial_dims=3, in_channels=1, out_channels=2,
        channels=(16, 32, 64, 128, 256), strides=(2, 2, 2, 2),
        num_res_units=2, norm=Norm.BATCH,
    )
    net = torch.nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[rank], output_device=rank)

    loss_function = DiceCELoss(to_onehot_y=True, softmax=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-5)
    dice_metric = DiceMetric(include_background=False, reduction="mean")
    post_pred = Compose([AsDiscrete(argmax=True, to_onehot=2)])
    post_label = Compose([AsDiscrete(to_onehot=2)])

    start_epoch, best_metric = 0, -1.0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume, map_location="cpu")
        net.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch = ckpt["epoch"]
        best_metric = ckpt.get("best_metric", -1.0)
        if rank == 0:
            print(f"resumed from {args.resume} at epoch {start_epoch}")

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        running, steps = torch.zeros(1, device=device), 0
        optimizer.zero_grad(set_to_none=True)
        for i, batch in enumerate(train_loader):
            inputs = batch["image"].to(device, non_blocking=True)
            targets = batch["label"].to(device, non_blocking=True)
            last_micro = (i + 1) % args.accum == 0 or (i + 1) == len(train_loader)
            ctx = contextlib.nullcontext() if last_micro else model.no_sync()
            with ctx:
                loss = loss_function(model(inputs), targets) / args.accum
                loss.backward()
            if last_micro:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            running += loss.detach() * args.accum
            steps += 1
        dist.all_reduce(running)
        epoch_loss = running.item() / (steps * world_size)
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs} average loss: {epoch_loss:.4f}")

        if (epoch + 1) % args.val_interval == 0:
            model.eval()
            with torch.no_grad():
                for batch in val_loader:
                    val_inputs = batch["image"].to(device)
                    val_labels = batch["label"].to(device)
                    val_outputs = sliding_window_inference(val_inputs, (160, 160, 160), 4, net)
                    val_outputs = [post_pred(x) for x in decollate_batch(val_outputs)]
                    val_labels = [post_label(x) for x in decollate_batch(val_labels)]
                    dice_metric(y_pred=val_outputs, y=val_labels)
                metric = dice_metric.aggregate().item()
                dice_metric.reset()
            if rank == 0:
                state = {
                    "epoch": epoch + 1,
                    "model": net.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "best_metric": max(best_metric, metric),
                }
                torch.save(state, os.path.join(args.out, "last.pt"))
                if metric > best_metric:
                    torch.save(state, os.path.join(args.out, "best.pt"))
                print(f"epoch {epoch + 1} val dice {metric:.4f} (best {max(best_metric, metric):.4f})")
            best_metric = max(best_metric, metric)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    args = get_args()
    if args.port == 0:
        args.port = free_port()
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)
