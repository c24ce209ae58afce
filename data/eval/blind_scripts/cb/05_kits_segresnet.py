#!/usr/bin/env python3
# KiTS19 kidney + tumour segmentation, SegResNet with deep supervision, multi-GPU.
#
#   torchrun --nproc_per_node=4 05_kits_segresnet.py --data /data/kits19 --fold 0 --work_dir work/kits_f0
import argparse
import json
import os
import time
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from monai.data import DataLoader, Dataset
from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.networks.nets import SegResNetDS
from monai.transforms import (
    Compose,
    CropForegroundd,
    EnsureTyped,
    LoadImaged,
    RandAffined,
    RandCropByLabelClassesd,
    RandFlipd,
    RandGaussianSmoothd,
    RandScaleIntensityd,
    ScaleIntensityRanged,
    Spacingd,
    SpatialPadd,
    EnsureChannelFirstd,
)

ROI = (160, 160, 96)


def build_transforms():
    pre = [
        LoadImaged(keys=["image", "label"], image_only=True),
        EnsureChannelFirstd(keys=["image", "label"]),
        Spacingd(keys=["image", "label"], pixdim=(0.78, 0.78, 1.0), mode=("bilinear", "nearest")),
        ScaleIntensityRanged(keys="image", a_min=-79, a_max=304, b_min=-1.0, b_max=1.0, clip=True),
        CropForegroundd(keys=["image", "label"], source_key="image", margin=10),
    ]
    train = Compose(pre + [
        SpatialPadd(keys=["image", "label"], spatial_size=ROI),
        # kidney and tumour oversampled over background
        RandCropByLabelClassesd(keys=["image", "label"], label_key="label", spatial_size=ROI,
                                num_classes=3, ratios=[1, 1, 2], num_samples=2),
        RandAffined(keys=["image", "label"], prob=0.2, rotate_range=(0.26, 0.26, 0.26),
                    scale_range=(0.15, 0.15, 0.15), mode=("bilinear", "nearest"), padding_mode="zeros"),
        RandGaussianSmoothd(keys="image", prob=0.1, sigma_x=(0.5, 1.0), sigma_y=(0.5, 1.0), sigma_z=(0.5, 1.0)),
        RandScaleIntensityd(keys="image", factors=0.25, prob=0.15),
        RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=0),
        RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=1),
        RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=2),
        EnsureTyped(keys=["image", "label"], track_meta=False),
    ])
    val = Compose(pre + [EnsureTyped(keys=["image", "label"], track_meta=False)])
    return train, val


def predict_volume(net, image, roi=ROI, sw_batch_size=2, overlap=0.5, mirror=True, sw_device="cuda:0"):
    """Whole-volume prediction; the volume itself stays on the CPU, patches are run on the GPU."""
    infer = partial(sliding_window_inference, roi_size=roi, sw_batch_size=sw_batch_size, predictor=net,
                    overlap=overlap, mode="gaussian", sw_device=sw_device, device="cpu")
    probs = infer(image).softmax(1)
    if mirror:
        for dims in ((2,), (3,), (4,)):
            probs += infer(torch.flip(image, dims)).softmax(1).flip(dims)
        probs /= 4
    return probs.argmax(1)


def dice(pred, gt, cls):
    if cls == "kidney":  # kidney + tumour
        p, g = pred > 0, gt > 0
    else:
        p, g = pred == 2, gt == 2
    denom = p.sum() + g.sum()
    return float("nan") if g.sum() == 0 else (2 * (p & g).sum() / denom).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--fold", type=int, default=0)
    ap.add_argument("--work_dir", default="work/kits")
    ap.add_argument("--epochs", type=int, default=600)
    ap.add_argument("--batch_size", type=int, default=1)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--val_every", type=int, default=20)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.backends.cudnn.benchmark = True

    with open(os.path.join(args.data, "kits_5fold.json")) as f:
        folds = json.load(f)
    to_item = lambda c: {"image": os.path.join(args.data, c, "imaging.nii.gz"),
                         "label": os.path.join(args.data, c, "segmentation.nii.gz")}
    train_items = [to_item(c) for k, cases in folds.items() if int(k) != args.fold for c in cases]
    val_items = [to_item(c) for c in folds[str(args.fold)]]

    train_tf, val_tf = build_transforms()
    train_ds = Dataset(train_items, train_tf)
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, persistent_workers=True)
    val_ds = Dataset(val_items[rank::world], val_tf)
    val_loader = DataLoader(val_ds, batch_size=1, num_workers=2)

    net = SegResNetDS(spatial_dims=3, init_filters=32, in_channels=1, out_channels=3,
                      blocks_down=(1, 2, 2, 4, 4), dsdepth=4, norm="INSTANCE").to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: (1 - e / args.epochs) ** 0.9)
    scaler = torch.cuda.amp.GradScaler()

    os.makedirs(args.work_dir, exist_ok=True)
    last_ckpt = os.path.join(args.work_dir, "last.pth")
    start, best = 0, -1.0
    if args.resume and os.path.exists(last_ckpt):
        sd = torch.load(last_ckpt, map_location="cpu")
        net.load_state_dict(sd["net"])
        opt.load_state_dict(sd["opt"])
        sched.load_state_dict(sd["sched"])
        scaler.load_state_dict(sd["scaler"])
        start, best = sd["epoch"] + 1, sd["best"]

    model = DDP(net, device_ids=[local_rank])
    loss_fn = DiceCELoss(include_background=False, to_onehot_y=True, softmax=True, squared_pred=True)

    for epoch in range(start, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        stats = torch.zeros(2, device=device)
        for batch in train_loader:
            x = batch["image"].to(device, non_blocking=True)
            y = batch["label"].to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                outs = model(x)  # list, full resolution first
                ws = [0.5 ** i for i in range(len(outs))]
                loss = 0.0
                for w, o in zip(ws, outs):
                    yt = y if o.shape[2:] == y.shape[2:] else F.interpolate(y, size=o.shape[2:], mode="nearest")
                    loss = loss + w * loss_fn(o, yt)
                loss = loss / sum(ws)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            stats += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(stats)
        if rank == 0:
            print(f"[ep {epoch:4d}] loss {stats[0].item() / stats[1].item():.4f} "
                  f"lr {sched.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)

        if (epoch + 1) % args.val_every == 0:
            net.eval()
            local = []
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
                for batch in val_loader:
                    pred = predict_volume(net, batch["image"])
                    gt = batch["label"][:, 0].long()
                    local.append((dice(pred, gt, "kidney"), dice(pred, gt, "tumour")))
            net.train()
            everything = [None] * world
            dist.all_gather_object(everything, local)
            if rank == 0:
                arr = np.array([r for part in everything for r in part], dtype=np.float64)
                kid, tum = np.nanmean(arr[:, 0]), np.nanmean(arr[:, 1])
                composite = (kid + tum) / 2
                print(f"[ep {epoch:4d}] val kidney {kid:.4f} tumour {tum:.4f} composite {composite:.4f} "
                      f"({len(arr)} cases)", flush=True)
                if composite > best:
                    best = composite
                    torch.save(net.state_dict(), os.path.join(args.work_dir, "best.pth"))
        if rank == 0:
            torch.save({"net": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch, "best": best}, last_ckpt)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
