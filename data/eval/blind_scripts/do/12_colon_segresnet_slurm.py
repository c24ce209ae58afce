#!/usr/bin/env python
"""Colon cancer primary tumour segmentation (MSD Task10) - SegResNet, Slurm multi-node.

Launched directly by srun, one task per GPU (see jobs/colon_seg.sbatch):

    #SBATCH --nodes=2 --ntasks-per-node=4 --gpus-per-node=4 --cpus-per-task=8
    export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    export MASTER_PORT=29533
    srun python 12_colon_segresnet_slurm.py --out /project/radonc/colon_seg/run_$SLURM_JOB_ID
"""
import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from monai.data import CacheDataset, DataLoader, Dataset, decollate_batch, load_decathlon_datalist
from monai.inferers import sliding_window_inference
from monai.losses import DiceFocalLoss
from monai.metrics import compute_dice
from monai.networks.nets import SegResNet
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
    RandGaussianNoised,
    RandRotate90d,
    ScaleIntensityRanged,
    Spacingd,
)

ROI = (192, 192, 64)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", default="/project/radonc/data/Task10_Colon")
    ap.add_argument("--out", default="/project/radonc/colon_seg/debug")
    ap.add_argument("--epochs", type=int, default=600)
    ap.add_argument("--batch_size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--val_every", type=int, default=10)
    ap.add_argument("--patience", type=int, default=15, help="validations without improvement")
    ap.add_argument("--resume", action="store_true")
    return ap.parse_args()


def setup_distributed():
    rank = int(os.environ["SLURM_PROCID"])
    world_size = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    torch.cuda.set_device(local_rank)
    # rank 0 validates the whole val set alone while the others wait at a barrier
    dist.init_process_group("nccl", init_method="env://", world_size=world_size, rank=rank,
                            timeout=timedelta(hours=1))
    return rank, world_size, local_rank


def transforms():
    pre = [
        LoadImaged(keys=["image", "label"]),
        EnsureChannelFirstd(keys=["image", "label"]),
        Orientationd(keys=["image", "label"], axcodes="RAS"),
        Spacingd(keys=["image", "label"], pixdim=(0.78, 0.78, 3.0), mode=("bilinear", "nearest")),
        ScaleIntensityRanged(keys="image", a_min=-57, a_max=175, b_min=0.0, b_max=1.0, clip=True),
        CropForegroundd(keys=["image", "label"], source_key="image"),
        EnsureTyped(keys=["image", "label"]),
    ]
    train = pre + [
        RandCropByPosNegLabeld(keys=["image", "label"], label_key="label", spatial_size=ROI, pos=2, neg=1,
                               num_samples=2),
        RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=0),
        RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=1),
        RandRotate90d(keys=["image", "label"], prob=0.25, spatial_axes=(0, 1)),
        RandGaussianNoised(keys="image", prob=0.15, std=0.02),
    ]
    return Compose(train), Compose(pre)


def main():
    args = parse_args()
    rank, world_size, local_rank = setup_distributed()
    device = torch.device("cuda", local_rank)

    files = load_decathlon_datalist(os.path.join(args.data_dir, "dataset.json"), True, "training",
                                    base_dir=args.data_dir)
    val_files, train_files = files[:25], files[25:]
    train_tf, val_tf = transforms()
    train_ds = CacheDataset(train_files, transform=train_tf, cache_rate=1.0, num_workers=8)
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                              pin_memory=True)

    net = SegResNet(spatial_dims=3, in_channels=1, out_channels=2, init_filters=32,
                    blocks_down=(1, 2, 2, 4), blocks_up=(1, 1, 1), norm=("group", {"num_groups": 8}))
    net = net.to(device)
    optimizer = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=1e-5)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    ckpt_path = os.path.join(args.out, "last.pt")
    start_epoch, best_dice, bad_vals = 0, 0.0, 0
    if args.resume and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        net.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_dice, bad_vals = ckpt["epoch"], ckpt["best_dice"], ckpt["bad_vals"]
    model = DDP(net, device_ids=[local_rank])

    loss_fn = DiceFocalLoss(to_onehot_y=True, softmax=True, include_background=False)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        val_loader = DataLoader(Dataset(val_files, transform=val_tf), batch_size=1, num_workers=4)
        post_pred = AsDiscrete(argmax=True, to_onehot=2)
        post_label = AsDiscrete(to_onehot=2)
        print(f"world size {world_size}, {len(train_files)} train / {len(val_files)} val cases", flush=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        stats = torch.zeros(2, device=device)
        for batch in train_loader:
            x = batch["image"].to(device, non_blocking=True)
            y = batch["label"].to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            stats += torch.stack([loss.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(stats)

        stop = torch.zeros(1, device=device)
        if rank == 0:
            print(f"[{epoch + 1}] loss {(stats[0] / stats[1]).item():.4f} {time.time() - t0:.0f}s", flush=True)
            if (epoch + 1) % args.val_every == 0:
                net.eval()
                case_dice = []
                with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
                    for batch in val_loader:
                        logits = sliding_window_inference(batch["image"].to(device), ROI, 4, net, overlap=0.5)
                        pred = torch.stack([post_pred(o) for o in decollate_batch(logits)])
                        gt = torch.stack([post_label(t) for t in decollate_batch(batch["label"].to(device))])
                        # per-case foreground dice
                        case_dice.append(compute_dice(pred, gt, include_background=False).nanmean().item())
                dice = sum(case_dice) / len(case_dice)
                if dice > best_dice:
                    best_dice, bad_vals = dice, 0
                    torch.save(net.state_dict(), os.path.join(args.out, "best.pt"))
                else:
                    bad_vals += 1
                print(f"    val dice {dice:.4f} best {best_dice:.4f} ({bad_vals} without improvement)", flush=True)
                torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(), "epoch": epoch + 1,
                            "best_dice": best_dice, "bad_vals": bad_vals}, ckpt_path)
                stop[0] = float(bad_vals >= args.patience)
        # every rank learns whether rank 0 decided to stop
        dist.broadcast(stop, src=0)
        if stop.item() > 0:
            if rank == 0:
                print("early stopping", flush=True)
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
