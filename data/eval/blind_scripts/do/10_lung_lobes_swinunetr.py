"""Pulmonary lobe segmentation on chest CT (5 lobes) with SwinUNETR.

Encoder initialised from the public self-supervised SwinUNETR weights.

    torchrun --nproc_per_node=4 10_lung_lobes_swinunetr.py \
        --json /data/lobes/datalist_5fold.json --fold 1 --pretrained /data/pretrained/model_swinvit.pt
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
from monai.networks.nets import SwinUNETR
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
    RandShiftIntensityd,
    ScaleIntensityRanged,
    Spacingd,
)

LOBES = ["LUL", "LLL", "RUL", "RML", "RLL"]


def parse_args():
    parser = argparse.ArgumentParser("lobe segmentation")
    parser.add_argument("--json", required=True)
    parser.add_argument("--fold", type=int, default=0)
    parser.add_argument("--pretrained", default=None)
    parser.add_argument("--output", default="./lobe_runs")
    parser.add_argument("--roi", type=int, default=96)
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--sw_batch_size", type=int, default=4)
    parser.add_argument("--max_epochs", type=int, default=400)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--weight_decay", type=float, default=1e-5)
    parser.add_argument("--val_every", type=int, default=20)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


def get_loaders(args, rank, world_size):
    with open(args.json) as f:
        data = json.load(f)
    train_files = [d for d in data["training"] if d["fold"] != args.fold]
    val_files = [d for d in data["training"] if d["fold"] == args.fold]
    roi = (args.roi,) * 3

    base = [
        LoadImaged(keys=["image", "label"]),
        EnsureChannelFirstd(keys=["image", "label"]),
        Orientationd(keys=["image", "label"], axcodes="RAS"),
        Spacingd(keys=["image", "label"], pixdim=(1.5, 1.5, 1.5), mode=("bilinear", "nearest")),
        ScaleIntensityRanged(keys="image", a_min=-1000, a_max=400, b_min=0.0, b_max=1.0, clip=True),
        CropForegroundd(keys=["image", "label"], source_key="label", margin=8),
    ]
    train_tf = Compose(base + [
        RandCropByPosNegLabeld(keys=["image", "label"], label_key="label", spatial_size=roi,
                               pos=3, neg=1, num_samples=4, image_key="image", image_threshold=0),
        RandFlipd(keys=["image", "label"], prob=0.1, spatial_axis=2),
        RandRotate90d(keys=["image", "label"], prob=0.1, max_k=3, spatial_axes=(0, 1)),
        RandShiftIntensityd(keys="image", offsets=0.1, prob=0.5),
        EnsureTyped(keys=["image", "label"]),
    ])
    val_tf = Compose(base + [EnsureTyped(keys=["image", "label"])])

    train_ds = CacheDataset(train_files, transform=train_tf, cache_rate=0.8, num_workers=args.workers)
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True)
    val_part = partition_dataset(val_files, num_partitions=world_size, shuffle=False, even_divisible=False)[rank]
    val_loader = DataLoader(Dataset(val_part, transform=val_tf), batch_size=1, num_workers=2)
    return train_loader, train_sampler, val_loader


def load_ssl_weights(model, path, rank):
    weights = torch.load(path, map_location="cpu")
    model.load_from(weights=weights)
    if rank == 0:
        print(f"loaded self-supervised encoder weights from {path}")


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    torch.backends.cudnn.benchmark = True

    train_loader, train_sampler, val_loader = get_loaders(args, rank, world_size)

    model = SwinUNETR(img_size=(args.roi,) * 3, in_channels=1, out_channels=len(LOBES) + 1,
                      feature_size=48, use_checkpoint=False)
    if args.pretrained:
        load_ssl_weights(model, args.pretrained, rank)
    model.to(device)
    ddp_model = DistributedDataParallel(model, device_ids=[args.local_rank], output_device=args.local_rank)

    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True, squared_pred=True)
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.max_epochs, eta_min=1e-6)
    scaler = torch.cuda.amp.GradScaler()
    dice_metric = DiceMetric(include_background=False, reduction="mean_batch", get_not_nans=False)
    post_pred = AsDiscrete(argmax=True, to_onehot=len(LOBES) + 1)
    post_label = AsDiscrete(to_onehot=len(LOBES) + 1)

    run_dir = os.path.join(args.output, f"fold{args.fold}")
    if rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    best = 0.0
    for epoch in range(args.max_epochs):
        train_sampler.set_epoch(epoch)
        ddp_model.train()
        tic = time.time()
        agg = torch.zeros(2, device=device)
        for batch in train_loader:
            img, lab = batch["image"].to(device), batch["label"].to(device)
            optimizer.zero_grad(set_to_none=True)
            with torch.cuda.amp.autocast():
                loss = loss_fn(ddp_model(img), lab)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            agg += torch.stack([loss.detach().float(), torch.tensor(1.0, device=device)])
        scheduler.step()
        dist.all_reduce(agg)
        if rank == 0:
            print(f"epoch {epoch + 1} loss {(agg[0] / agg[1]).item():.4f} time {time.time() - tic:.1f}s", flush=True)

        if (epoch + 1) % args.val_every == 0:
            model.eval()
            with torch.no_grad():
                for batch in val_loader:
                    img, lab = batch["image"].to(device), batch["label"].to(device)
                    with torch.cuda.amp.autocast():
                        out = sliding_window_inference(img, (args.roi,) * 3, args.sw_batch_size, model,
                                                       overlap=0.5)
                    dice_metric(y_pred=[post_pred(o) for o in decollate_batch(out)],
                                y=[post_label(t) for t in decollate_batch(lab)])
            per_lobe = dice_metric.aggregate().cpu().numpy()
            dice_metric.reset()
            mean = float(np.mean(per_lobe))
            if rank == 0:
                print("  " + "  ".join(f"{n} {d:.4f}" for n, d in zip(LOBES, per_lobe)) + f"  mean {mean:.4f}",
                      flush=True)
                ckpt = {"epoch": epoch + 1, "state_dict": model.state_dict(),
                        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "best": best}
                torch.save(ckpt, os.path.join(run_dir, "model_final.pt"))
                if mean > best:
                    best = mean
                    torch.save(model.state_dict(), os.path.join(run_dir, "model_best.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
