"""ER / mitochondria / nucleus semantic segmentation on FIB-SEM crops (OpenOrganelle / COSEM style)
with MONAI.  Validation runs sliding-window inference on whole held-out crops; the crops are
divided between the GPUs.

    torchrun --nproc_per_node=4 09_cosem_er_monai.py --crops /groups/cosem/crops.json --out runs/cosem_er_01
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import zarr
from monai.data import DataLoader, Dataset
from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.metrics import DiceMetric
from monai.networks.nets import UNet
from monai.transforms import (Compose, EnsureChannelFirstd, RandCropByPosNegLabeld, RandFlipd,
                              RandRotate90d, RandScaleIntensityd, RandShiftIntensityd, ScaleIntensityRanged)
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

CLASSES = ["bg", "er", "mito", "nucleus"]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--crops", required=True, help="json with train/val lists of zarr crops")
    p.add_argument("--out", required=True)
    p.add_argument("--roi", type=int, nargs=3, default=[96, 96, 96])
    p.add_argument("--samples-per-crop", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--val-every", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--workers", type=int, default=4)
    return p.parse_args()


def load_crop(entry):
    z = zarr.open(entry["path"], mode="r")
    img = np.asarray(z["em/s0"], dtype=np.float32)
    lab = np.asarray(z["labels/s0"], dtype=np.int64)
    return {"image": img, "label": lab, "name": entry["name"]}


def transforms(roi, n, train):
    base = [EnsureChannelFirstd(keys=["image", "label"], channel_dim="no_channel"),
            ScaleIntensityRanged(keys="image", a_min=0, a_max=255, b_min=0.0, b_max=1.0, clip=True)]
    if not train:
        return Compose(base)
    return Compose(base + [
        RandCropByPosNegLabeld(keys=["image", "label"], label_key="label", spatial_size=roi,
                               pos=2, neg=1, num_samples=n, image_key="image"),
        RandFlipd(keys=["image", "label"], spatial_axis=[0], prob=0.5),
        RandFlipd(keys=["image", "label"], spatial_axis=[1], prob=0.5),
        RandFlipd(keys=["image", "label"], spatial_axis=[2], prob=0.5),
        RandRotate90d(keys=["image", "label"], prob=0.5, spatial_axes=(1, 2)),
        RandScaleIntensityd(keys="image", factors=0.1, prob=0.5),
        RandShiftIntensityd(keys="image", offsets=0.1, prob=0.5),
    ])


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    with open(args.crops) as f:
        split = json.load(f)
    train_items = [load_crop(e) for e in split["train"]]
    val_items = [load_crop(e) for e in split["val"]][rank::world]

    train_ds = Dataset(train_items, transforms(args.roi, args.samples_per_crop, True))
    val_ds = Dataset(val_items, transforms(args.roi, 1, False))
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=1, num_workers=1)

    model = UNet(spatial_dims=3, in_channels=1, out_channels=len(CLASSES),
                 channels=(32, 64, 128, 256, 320), strides=(2, 2, 2, 2), num_res_units=2,
                 norm="instance").to(device)
    model = DDP(model, device_ids=[local_rank])
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True, include_background=False)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=4)
    dice_metric = DiceMetric(include_background=False, reduction="mean_batch")

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"train crops {len(train_items)}, val crops on rank0 {len(val_items)}, world {world}")

    best_dice, best_epoch = -1.0, -1
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        epoch_loss = torch.zeros(2, device=device)
        for batch in train_loader:
            x, y = batch["image"].to(device), batch["label"].to(device)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            epoch_loss += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(epoch_loss)
        if rank == 0:
            print(f"epoch {epoch} loss {(epoch_loss[0] / epoch_loss[1]).item():.4f} ({time.time() - t0:.0f}s)",
                  flush=True)

        if (epoch + 1) % args.val_every:
            continue
        model.eval()
        dice_metric.reset()
        with torch.no_grad():
            for batch in val_loader:
                x, y = batch["image"].to(device), batch["label"].to(device)
                logits = sliding_window_inference(x, args.roi, sw_batch_size=4, predictor=model.module,
                                                  overlap=0.5, mode="gaussian")
                pred = torch.nn.functional.one_hot(logits.argmax(1), len(CLASSES)).permute(0, 4, 1, 2, 3)
                gt = torch.nn.functional.one_hot(y[:, 0], len(CLASSES)).permute(0, 4, 1, 2, 3)
                dice_metric(y_pred=pred, y=gt)
        per_class = dice_metric.aggregate()
        mean_dice = per_class.mean().item()
        sched.step(mean_dice)

        if rank == 0:
            print("  val dice " + " ".join(f"{c}={d:.3f}" for c, d in zip(CLASSES[1:], per_class.tolist()))
                  + f" mean={mean_dice:.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "dice": mean_dice},
                       os.path.join(args.out, "last.pt"))
            if mean_dice > best_dice:
                best_dice, best_epoch = mean_dice, epoch
                torch.save(model.module.state_dict(), os.path.join(args.out, "best_model.pt"))
                print(f"  new best {best_dice:.4f} at epoch {best_epoch}", flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
