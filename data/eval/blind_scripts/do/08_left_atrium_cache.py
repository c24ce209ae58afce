"""Left atrium segmentation from MRI (MSD Task02_Heart), Attention U-Net.

Only 20 labelled volumes, so everything is cached in memory and we train with
many random patches per volume.

    torchrun --standalone --nproc_per_node=4 08_left_atrium_cache.py --out /nas/la_seg/attn_unet
"""
import argparse
import logging
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from monai.data import CacheDataset, DataLoader, decollate_batch, load_decathlon_datalist, partition_dataset
from monai.inferers import sliding_window_inference
from monai.losses import DiceLoss
from monai.metrics import DiceMetric, HausdorffDistanceMetric
from monai.networks.nets import AttentionUnet
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
    RandRotate90d,
    RandScaleIntensityd,
    RandShiftIntensityd,
    Spacingd,
)
from monai.utils import set_determinism

PATCH = (96, 96, 96)


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", default="/nas/datasets/Task02_Heart")
    p.add_argument("--out", default="/nas/la_seg/attn_unet")
    p.add_argument("--max_epochs", type=int, default=1000)
    p.add_argument("--batch_size", type=int, default=2)
    p.add_argument("--samples_per_volume", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--eval_interval", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def get_transforms(samples):
    pre = [
        LoadImaged(keys=["image", "label"]),
        EnsureChannelFirstd(keys=["image", "label"]),
        Orientationd(keys=["image", "label"], axcodes="RAS"),
        Spacingd(keys=["image", "label"], pixdim=(1.25, 1.25, 1.37), mode=("bilinear", "nearest")),
        NormalizeIntensityd(keys="image", nonzero=True),
        CropForegroundd(keys=["image", "label"], source_key="image"),
        EnsureTyped(keys=["image", "label"]),
    ]
    train = pre + [
        RandCropByPosNegLabeld(keys=["image", "label"], label_key="label", spatial_size=PATCH,
                               pos=1, neg=1, num_samples=samples),
        RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=0),
        RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=1),
        RandRotate90d(keys=["image", "label"], prob=0.3, spatial_axes=(0, 1)),
        RandScaleIntensityd(keys="image", factors=0.1, prob=0.5),
        RandShiftIntensityd(keys="image", offsets=0.1, prob=0.5),
    ]
    return Compose(train), Compose(pre)


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    world = dist.get_world_size()
    rank = dist.get_rank()
    device = torch.device(f"cuda:{local_rank}")

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format=f"[rank{rank}] %(asctime)s %(message)s")
    log = logging.getLogger(__name__)
    set_determinism(args.seed)

    datalist = load_decathlon_datalist(os.path.join(args.data_dir, "dataset.json"), True, "training",
                                       base_dir=args.data_dir)
    train_files, val_files = datalist[:16], datalist[16:]
    train_tf, val_tf = get_transforms(args.samples_per_volume)

    train_ds = CacheDataset(train_files, transform=train_tf, cache_rate=1.0, num_workers=4)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=4,
                              pin_memory=True, drop_last=True)
    val_ds = CacheDataset(partition_dataset(val_files, num_partitions=world, even_divisible=False)[rank],
                          transform=val_tf, cache_rate=1.0, num_workers=2)
    val_loader = DataLoader(val_ds, batch_size=1, num_workers=1)

    net = AttentionUnet(spatial_dims=3, in_channels=1, out_channels=2,
                        channels=(16, 32, 64, 128, 256), strides=(2, 2, 2, 2), dropout=0.1).to(device)
    model = DDP(net, device_ids=[local_rank], output_device=local_rank)
    loss_fn = DiceLoss(to_onehot_y=True, softmax=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0=200)
    scaler = torch.cuda.amp.GradScaler()

    dice_metric = DiceMetric(include_background=False, reduction="mean")
    hd95_metric = HausdorffDistanceMetric(include_background=False, percentile=95, reduction="mean")
    post_pred = AsDiscrete(argmax=True, to_onehot=2)
    post_label = AsDiscrete(to_onehot=2)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_dice = 0.0

    for epoch in range(args.max_epochs):
        model.train()
        t0 = time.time()
        loss_total = torch.zeros(1, device=device)
        n_batches = 0
        for batch in train_loader:
            x = batch["image"].to(device, non_blocking=True)
            y = batch["label"].to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.cuda.amp.autocast():
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            loss_total += loss.detach()
            n_batches += 1
        scheduler.step()
        dist.all_reduce(loss_total)
        log.info("epoch %d loss %.4f (%.1fs)", epoch + 1, loss_total.item() / (n_batches * world), time.time() - t0)

        if (epoch + 1) % args.eval_interval == 0:
            model.eval()
            with torch.no_grad():
                for batch in val_loader:
                    x = batch["image"].to(device)
                    y = batch["label"].to(device)
                    with torch.cuda.amp.autocast():
                        logits = sliding_window_inference(x, PATCH, 4, net, overlap=0.5)
                    preds = [post_pred(p) for p in decollate_batch(logits)]
                    gts = [post_label(t) for t in decollate_batch(y)]
                    dice_metric(y_pred=preds, y=gts)
                    hd95_metric(y_pred=preds, y=gts)
            mean_dice = dice_metric.aggregate().item()
            mean_hd95 = hd95_metric.aggregate().item()
            dice_metric.reset()
            hd95_metric.reset()
            if rank == 0:
                log.info("  val dice %.4f  hd95 %.2f mm", mean_dice, mean_hd95)
                torch.save({"epoch": epoch + 1, "model": net.state_dict(), "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict()}, os.path.join(args.out, "last.pth"))
                if mean_dice > best_dice:
                    best_dice = mean_dice
                    torch.save(net.state_dict(), os.path.join(args.out, "best_dice.pth"))
                    log.info("  new best")
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
