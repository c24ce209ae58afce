"""
Brain metastases segmentation (T1c + FLAIR) with DynUNet and deep supervision.
Small lesions -> high-resolution patches, lesion-weighted crops, DiceFocal loss.

    torchrun --nproc_per_node=4 19_brainmets_dynunet_ds.py --cfg configs/mets_dynunet.json
"""
import argparse
import json
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter

from monai.data import CacheDataset, DataLoader, DistributedSampler, decollate_batch
from monai.inferers import sliding_window_inference
from monai.losses import DiceFocalLoss
from monai.metrics import DiceMetric
from monai.networks.nets import DynUNet
from monai.transforms import (AsDiscrete, Compose, ConcatItemsd, DeleteItemsd, EnsureChannelFirstd, EnsureTyped,
                              LoadImaged, NormalizeIntensityd, Orientationd, RandCropByPosNegLabeld, RandFlipd,
                              RandGaussianNoised, RandRotate90d, Spacingd, SpatialPadd)

DS_WEIGHTS = [1.0, 0.5, 0.25]
PATCH = (128, 128, 128)


def get_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    ap.add_argument("--datalist", default="/data/brainmets/datalist.json")
    ap.add_argument("--out", default="runs/mets_dynunet")
    ap.add_argument("--epochs", type=int, default=600)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--deep_supr_num", type=int, default=3)
    ap.add_argument("--val_every", type=int, default=10)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()
    if args.cfg:
        with open(args.cfg) as f:
            for k, v in json.load(f).items():
                setattr(args, k, v)
    return args


def transforms():
    mods = ["t1c", "flair"]
    keys = mods + ["label"]
    pre = [LoadImaged(keys=keys), EnsureChannelFirstd(keys=keys), Orientationd(keys=keys, axcodes="RAS"),
           Spacingd(keys=keys, pixdim=(1.0, 1.0, 1.0), mode=("bilinear", "bilinear", "nearest")),
           NormalizeIntensityd(keys=mods, nonzero=True),
           ConcatItemsd(keys=mods, name="image"), DeleteItemsd(keys=mods),
           EnsureTyped(keys=["image", "label"], track_meta=False)]
    train = Compose(pre + [
        SpatialPadd(keys=["image", "label"], spatial_size=PATCH),
        RandCropByPosNegLabeld(keys=["image", "label"], label_key="label", spatial_size=PATCH, pos=3, neg=1,
                               num_samples=2),
        RandFlipd(keys=["image", "label"], spatial_axis=[0], prob=0.5),
        RandRotate90d(keys=["image", "label"], prob=0.3, max_k=3),
        RandGaussianNoised(keys="image", prob=0.2, std=0.05),
    ])
    return train, Compose(pre)


def main():
    args = get_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(format="%(asctime)s %(message)s", level=logging.INFO if rank == 0 else logging.ERROR)
    log = logging.getLogger("mets")

    with open(args.datalist) as f:
        dl = json.load(f)
    train_tf, val_tf = transforms()
    train_ds = CacheDataset(dl["training"], train_tf, cache_rate=1.0, num_workers=args.workers)
    val_ds = CacheDataset(dl["validation"], val_tf, cache_rate=1.0, num_workers=args.workers)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, even_divisible=False)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=1, sampler=val_sampler, num_workers=2)

    kernels = [[3, 3, 3]] * 6
    strides = [[1, 1, 1]] + [[2, 2, 2]] * 5
    net = DynUNet(spatial_dims=3, in_channels=2, out_channels=2, kernel_size=kernels, strides=strides,
                  upsample_kernel_size=strides[1:], filters=[32, 64, 128, 256, 320, 320], norm_name="instance",
                  deep_supervision=True, deep_supr_num=args.deep_supr_num, res_block=True).to(device)
    model = DDP(net, device_ids=[local_rank])

    loss_fn = DiceFocalLoss(to_onehot_y=True, softmax=True, include_background=False, batch=True, gamma=2.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.99, nesterov=True, weight_decay=3e-5)
    scheduler = torch.optim.lr_scheduler.PolynomialLR(optimizer, total_iters=args.epochs, power=0.9)
    scaler = torch.cuda.amp.GradScaler()
    dice_metric = DiceMetric(include_background=False, reduction="mean")
    post_pred, post_lbl = AsDiscrete(argmax=True, to_onehot=2), AsDiscrete(to_onehot=2)
    ds_norm = sum(DS_WEIGHTS)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    writer = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None
    best = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        stats = torch.zeros(2, device=device)
        for batch in train_loader:
            x, y = batch["image"].to(device, non_blocking=True), batch["label"].to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.cuda.amp.autocast():
                outputs = model(x)  # (B, 1 + deep_supr_num, C, ...) all at input resolution
                loss = sum(w * loss_fn(o, y) for w, o in zip(DS_WEIGHTS, outputs.unbind(1))) / ds_norm
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 12)
            scaler.step(optimizer)
            scaler.update()
            stats += torch.stack([loss.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(stats)
        train_loss = (stats[0] / stats[1]).item()
        log.info("epoch %d loss %.4f lr %.5f (%.0fs)", epoch, train_loss, scheduler.get_last_lr()[0], time.time() - t0)
        if writer:
            writer.add_scalar("train/loss", train_loss, epoch)

        if (epoch + 1) % args.val_every:
            continue
        net.eval()
        with torch.no_grad():
            for batch in val_loader:
                x, y = batch["image"].to(device), batch["label"].to(device)
                with torch.cuda.amp.autocast():
                    logits = sliding_window_inference(x, PATCH, 2, net, overlap=0.5, mode="gaussian")
                dice_metric(y_pred=[post_pred(p) for p in decollate_batch(logits)],
                            y=[post_lbl(t) for t in decollate_batch(y)])
        val_dice = dice_metric.aggregate().item()
        dice_metric.reset()
        log.info("epoch %d val dice %.4f", epoch, val_dice)
        if rank == 0:
            writer.add_scalar("val/dice", val_dice, epoch)
            ck = {"epoch": epoch, "model": net.state_dict(), "optimizer": optimizer.state_dict(),
                  "scheduler": scheduler.state_dict(), "val_dice": val_dice}
            torch.save(ck, os.path.join(args.out, "last.pt"))
            if val_dice > best:
                torch.save(ck, os.path.join(args.out, "best.pt"))
        best = max(best, val_dice)

    if writer:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
