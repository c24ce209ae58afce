"""Whole-heart substructure segmentation on CT (MM-WHS 2017, 7 structures).

Training runs on all GPUs; validation is cheap (20 volumes) so it is done on
rank 0 with the unwrapped network while the other ranks wait.

    torchrun --standalone --nproc_per_node=4 16_mmwhs_rank0_eval.py --fold 0
"""
import argparse
import json
import os
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from monai.data import CacheDataset, DataLoader, Dataset, decollate_batch
from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.metrics import DiceMetric
from monai.networks.nets import BasicUNet
from monai.transforms import (
    AsDiscrete,
    Compose,
    EnsureChannelFirstd,
    EnsureTyped,
    LoadImaged,
    MapLabelValued,
    Orientationd,
    RandAdjustContrastd,
    RandAffined,
    RandCropByPosNegLabeld,
    ScaleIntensityRanged,
    Spacingd,
)

# MM-WHS label values -> contiguous class indices
MMWHS_VALUES = [0, 205, 420, 500, 550, 600, 820, 850]
STRUCTURES = ["LV", "RV", "LA", "RA", "Myo", "AA", "PA"]
ROI = (128, 128, 128)


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data_json", default="/data/mmwhs/ct_train_5fold.json")
    parser.add_argument("--fold", type=int, default=0)
    parser.add_argument("--logdir", default="/data/mmwhs/runs/basicunet")
    parser.add_argument("--max_epochs", type=int, default=500)
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--val_interval", type=int, default=10)
    return parser.parse_args()


def get_transforms():
    pre = [
        LoadImaged(keys=["image", "label"]),
        EnsureChannelFirstd(keys=["image", "label"]),
        Orientationd(keys=["image", "label"], axcodes="RAS"),
        Spacingd(keys=["image", "label"], pixdim=(1.0, 1.0, 1.0), mode=("bilinear", "nearest")),
        MapLabelValued(keys="label", orig_labels=MMWHS_VALUES, target_labels=list(range(len(MMWHS_VALUES)))),
        ScaleIntensityRanged(keys="image", a_min=-200, a_max=800, b_min=0.0, b_max=1.0, clip=True),
        EnsureTyped(keys=["image", "label"]),
    ]
    aug = [
        RandCropByPosNegLabeld(keys=["image", "label"], label_key="label", spatial_size=ROI, pos=3, neg=1,
                               num_samples=2),
        RandAffined(keys=["image", "label"], prob=0.5, rotate_range=(0.3, 0.3, 0.3), scale_range=(0.15,) * 3,
                    mode=("bilinear", "nearest"), padding_mode="border"),
        RandAdjustContrastd(keys="image", prob=0.3, gamma=(0.7, 1.5)),
    ]
    return Compose(pre + aug), Compose(pre)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=timedelta(minutes=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    with open(args.data_json) as f:
        folds = json.load(f)
    train_files = [c for k, v in folds.items() if k != f"fold{args.fold}" for c in v]
    val_files = folds[f"fold{args.fold}"]

    train_tf, val_tf = get_transforms()
    train_ds = CacheDataset(train_files, train_tf, cache_rate=1.0, num_workers=8)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                              pin_memory=True)

    net = BasicUNet(spatial_dims=3, in_channels=1, out_channels=len(MMWHS_VALUES),
                    features=(32, 32, 64, 128, 256, 32), norm=("instance", {"affine": True}), dropout=0.1)
    net = net.to(device)
    model = DDP(net, device_ids=[local_rank], output_device=local_rank)
    loss_function = DiceCELoss(to_onehot_y=True, softmax=True, lambda_ce=0.5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.max_epochs,
                                                    pct_start=0.05)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.logdir, exist_ok=True)
        writer = SummaryWriter(args.logdir)
        val_loader = DataLoader(Dataset(val_files, val_tf), batch_size=1, num_workers=4)
        dice_metric = DiceMetric(include_background=False, reduction="mean_batch")
        post_pred = AsDiscrete(argmax=True, to_onehot=len(MMWHS_VALUES))
        post_label = AsDiscrete(to_onehot=len(MMWHS_VALUES))
        best_metric = -1.0

    for epoch in range(args.max_epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        epoch_loss = torch.zeros(2, device=device)
        for batch in train_loader:
            x, y = batch["image"].to(device, non_blocking=True), batch["label"].to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = loss_function(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            epoch_loss += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(epoch_loss)

        if rank == 0:
            mean_loss = (epoch_loss[0] / epoch_loss[1]).item()
            writer.add_scalar("train_loss", mean_loss, epoch + 1)
            print(f"epoch {epoch + 1} loss {mean_loss:.4f} lr {scheduler.get_last_lr()[0]:.2e} "
                  f"{time.time() - tic:.0f}s", flush=True)

            if (epoch + 1) % args.val_interval == 0:
                net.eval()
                with torch.no_grad():
                    for val_data in val_loader:
                        vx, vy = val_data["image"].to(device), val_data["label"].to(device)
                        with torch.autocast("cuda", dtype=torch.float16):
                            vout = sliding_window_inference(vx, ROI, 4, net, overlap=0.5)
                        dice_metric(y_pred=[post_pred(i) for i in decollate_batch(vout)],
                                    y=[post_label(i) for i in decollate_batch(vy)])
                per_structure = dice_metric.aggregate().cpu().numpy()
                dice_metric.reset()
                metric = float(np.mean(per_structure))
                for name, d in zip(STRUCTURES, per_structure):
                    writer.add_scalar(f"val_dice/{name}", d, epoch + 1)
                writer.add_scalar("val_dice/mean", metric, epoch + 1)
                if metric > best_metric:
                    best_metric = metric
                    torch.save(net.state_dict(), os.path.join(args.logdir, f"best_fold{args.fold}.pth"))
                print(f"  mean dice {metric:.4f} (best {best_metric:.4f})", flush=True)
                torch.save({"epoch": epoch + 1, "model": net.state_dict(), "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict()}, os.path.join(args.logdir, "checkpoint.pth"))
        dist.barrier()

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
