"""
BraTS 2021 brain tumour segmentation (TC / WT / ET) with a MONAI 3D residual U-Net.

    torchrun --nproc_per_node=8 04_monai_unet3d_brats.py \
        --data-json /data/brats21/dataset_5fold.json --fold 0 --out runs/unet3d_f0

Random 128^3 crops for training, full-volume sliding-window inference for
validation.  Mixed precision with GradScaler.
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from monai.data import DataLoader, Dataset, decollate_batch, partition_dataset
from monai.inferers import sliding_window_inference
from monai.losses import DiceLoss
from monai.networks.layers import Norm
from monai.networks.nets import UNet
from monai.transforms import (Activations, AsDiscrete, Compose, ConvertToMultiChannelBasedOnBratsClassesd,
                              EnsureChannelFirstd, EnsureTyped, LoadImaged, NormalizeIntensityd,
                              Orientationd, RandFlipd, RandScaleIntensityd, RandShiftIntensityd,
                              RandSpatialCropd, Spacingd)
from monai.utils import set_determinism
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

KEYS = ["image", "label"]


def get_transforms(roi):
    common = [
        LoadImaged(keys=KEYS),
        EnsureChannelFirstd(keys="image"),
        EnsureTyped(keys=KEYS),
        ConvertToMultiChannelBasedOnBratsClassesd(keys="label"),
        Orientationd(keys=KEYS, axcodes="RAS"),
        Spacingd(keys=KEYS, pixdim=(1.0, 1.0, 1.0), mode=("bilinear", "nearest")),
    ]
    train = Compose(common + [
        RandSpatialCropd(keys=KEYS, roi_size=roi, random_size=False),
        RandFlipd(keys=KEYS, prob=0.5, spatial_axis=0),
        RandFlipd(keys=KEYS, prob=0.5, spatial_axis=1),
        RandFlipd(keys=KEYS, prob=0.5, spatial_axis=2),
        NormalizeIntensityd(keys="image", nonzero=True, channel_wise=True),
        RandScaleIntensityd(keys="image", factors=0.1, prob=1.0),
        RandShiftIntensityd(keys="image", offsets=0.1, prob=1.0),
    ])
    val = Compose(common + [NormalizeIntensityd(keys="image", nonzero=True, channel_wise=True)])
    return train, val


def load_split(data_json, fold):
    with open(data_json) as f:
        items = json.load(f)["training"]
    root = os.path.dirname(data_json)
    for it in items:
        it["image"] = [os.path.join(root, p) for p in it["image"]]
        it["label"] = os.path.join(root, it["label"])
    train = [it for it in items if it["fold"] != fold]
    val = [it for it in items if it["fold"] == fold]
    return train, val


def build_model():
    return UNet(
        spatial_dims=3,
        in_channels=4,
        out_channels=3,
        channels=(32, 64, 128, 256, 320),
        strides=(2, 2, 2, 2),
        num_res_units=2,
        norm=Norm.BATCH,
        dropout=0.0,
    )


@torch.no_grad()
def evaluate(model, loader, roi, device):
    model.eval()
    post_sigmoid = Activations(sigmoid=True)
    post_pred = AsDiscrete(threshold=0.5)
    dice_sum = torch.zeros(3, device=device)
    count = torch.zeros(3, device=device)
    for batch in loader:
        image, label = batch["image"].to(device), batch["label"].to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = sliding_window_inference(image, roi, 4, model.module, overlap=0.5)
        preds = [post_pred(post_sigmoid(p)) for p in decollate_batch(logits)]
        for pred, gt in zip(preds, decollate_batch(label)):
            inter = (pred * gt).sum(dim=(1, 2, 3))
            denom = pred.sum(dim=(1, 2, 3)) + gt.sum(dim=(1, 2, 3))
            valid = gt.sum(dim=(1, 2, 3)) > 0
            dice_sum += torch.where(valid, 2 * inter / denom.clamp(min=1), torch.zeros_like(inter))
            count += valid.float()
    dist.all_reduce(dice_sum)
    dist.all_reduce(count)
    return (dice_sum / count.clamp(min=1)).tolist()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-json", required=True)
    ap.add_argument("--fold", type=int, default=0)
    ap.add_argument("--out", default="runs/unet3d")
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=2, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--val-every", type=int, default=10)
    ap.add_argument("--roi", type=int, nargs=3, default=[128, 128, 128])
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    set_determinism(seed=0)

    train_files, val_files = load_split(args.data_json, args.fold)
    train_tf, val_tf = get_transforms(args.roi)
    train_ds = Dataset(train_files, transform=train_tf)
    # validation: unpadded shard per rank, Dice is summed then reduced
    val_part = partition_dataset(val_files, num_partitions=world, shuffle=False, even_divisible=False)[rank]
    val_ds = Dataset(val_part, transform=val_tf)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=8, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=1, num_workers=4)

    model = build_model().to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    loss_fn = DiceLoss(smooth_nr=0, smooth_dr=1e-5, squared_pred=True, to_onehot_y=False, sigmoid=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * world, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"train {len(train_files)} val {len(val_files)} world {world} "
              f"global batch {args.batch_size * world}", flush=True)

    best = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, epoch_loss = time.time(), torch.zeros(2, device=device)
        for batch in train_loader:
            image = batch["image"].to(device, non_blocking=True)
            label = batch["label"].to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = loss_fn(model(image), label)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            epoch_loss += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(epoch_loss)
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs} loss {(epoch_loss[0] / epoch_loss[1]).item():.4f} "
                  f"time {time.time() - t0:.0f}s", flush=True)

        if (epoch + 1) % args.val_every == 0:
            tc, wt, et = evaluate(model, val_loader, args.roi, device)
            mean_dice = (tc + wt + et) / 3
            if rank == 0:
                print(f"  val dice TC {tc:.4f} WT {wt:.4f} ET {et:.4f} mean {mean_dice:.4f}", flush=True)
                if mean_dice > best:
                    best = mean_dice
                    torch.save(model.module.state_dict(), os.path.join(args.out, "best_metric_model.pt"))
            dist.barrier()

    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(args.out, "final_model.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
