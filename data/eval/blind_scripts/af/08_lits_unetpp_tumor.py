"""LiTS liver + tumour segmentation, UNet++ with deep supervision, DDP + AMP.

    torchrun --nproc_per_node=4 08_lits_unetpp_tumor.py --root /data/LiTS --exp lits_unetpp_v3
"""
import argparse
import datetime
import logging
import os
import time
from glob import glob

import torch
import torch.distributed as dist
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP

from monai.data import DataLoader, DistributedSampler, PersistentDataset, decollate_batch
from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.metrics import DiceMetric
from monai.networks.nets import BasicUNetPlusPlus
from monai.transforms import (AsDiscreted, Compose, CropForegroundd, EnsureChannelFirstd, EnsureTyped,
                              LoadImaged, Orientationd, RandAdjustContrastd, RandFlipd,
                              RandSpatialCropSamplesd, ScaleIntensityRanged, Spacingd, SpatialPadd)

log = logging.getLogger(__name__)


def args_parser():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/LiTS")
    ap.add_argument("--cache", default="/data/LiTS/persistent_cache")
    ap.add_argument("--exp", default="lits_unetpp")
    ap.add_argument("--ckpt_dir", default="/checkpoints")
    ap.add_argument("--epochs", type=int, default=500)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--patch", type=int, nargs=3, default=[128, 128, 64])
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--val_every", type=int, default=10)
    ap.add_argument("--n_val", type=int, default=20)
    ap.add_argument("--wandb_project", default="lits-seg")
    return ap.parse_args()


def make_transforms(patch):
    keys = ["image", "label"]
    pre = [
        LoadImaged(keys=keys, image_only=True),
        EnsureChannelFirstd(keys=keys),
        Orientationd(keys=keys, axcodes="RAS"),
        Spacingd(keys=keys, pixdim=(0.8, 0.8, 1.5), mode=("bilinear", "nearest")),
        ScaleIntensityRanged(keys="image", a_min=-100, a_max=250, b_min=0.0, b_max=1.0, clip=True),
        CropForegroundd(keys=keys, source_key="image", margin=8),
        EnsureTyped(keys=keys, track_meta=False),
    ]
    train = Compose(pre + [
        SpatialPadd(keys=keys, spatial_size=patch),
        RandSpatialCropSamplesd(keys=keys, roi_size=patch, num_samples=4, random_size=False),
        RandFlipd(keys=keys, prob=0.5, spatial_axis=[0, 1]),
        RandAdjustContrastd(keys="image", prob=0.2, gamma=(0.8, 1.25)),
    ])
    val = Compose(pre)
    return train, val


def main():
    args = args_parser()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO, format=f"[rank{rank}] %(asctime)s %(message)s")

    vols = sorted(glob(os.path.join(args.root, "volume-*.nii")), key=lambda p: int(p.split("-")[-1][:-4]))
    data = [{"image": v, "label": v.replace("volume-", "segmentation-")} for v in vols]
    train_files, val_files = data[args.n_val:], data[:args.n_val]

    train_tf, val_tf = make_transforms(args.patch)
    if rank == 0:
        # build the persistent cache once; other ranks read it afterwards
        for item in PersistentDataset(train_files + val_files, transform=val_tf, cache_dir=args.cache):
            pass
    dist.barrier()
    train_ds = PersistentDataset(train_files, transform=train_tf, cache_dir=args.cache)
    val_ds = PersistentDataset(val_files, transform=val_tf, cache_dir=args.cache)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, even_divisible=False)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=6,
                              pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=1, sampler=val_sampler, num_workers=2)

    model = BasicUNetPlusPlus(spatial_dims=3, in_channels=1, out_channels=3, features=(32, 32, 64, 128, 256, 32),
                              deep_supervision=True).to(dev)
    model = DDP(model, device_ids=[local_rank])
    criterion = DiceCELoss(to_onehot_y=True, softmax=True, lambda_dice=1.0, lambda_ce=1.0)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs, eta_min=1e-6)
    scaler = torch.cuda.amp.GradScaler()
    dice = DiceMetric(include_background=False, reduction="mean_batch")
    post = AsDiscreted(keys=["pred", "label"], argmax=(True, False), to_onehot=(3, 3))

    run = None
    if rank == 0:
        run = wandb.init(project=args.wandb_project, name=args.exp, config=vars(args))
    out_dir = os.path.join(args.ckpt_dir, args.exp)
    os.makedirs(out_dir, exist_ok=True)

    best_tumor = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=dev)
        for batch in train_loader:
            img = batch["image"].to(dev, non_blocking=True)
            lbl = batch["label"].to(dev, non_blocking=True)
            if lbl.max() == 0:
                # uniform crops often land outside the liver; pure background patches only add noise
                continue
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device_type="cuda", dtype=torch.float16):
                outs = model(img)
                loss = sum(criterion(o, lbl) for o in outs) / len(outs)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            loss_sum[0] += loss.detach()
            loss_sum[1] += 1
        sched.step()
        dist.all_reduce(loss_sum)
        train_loss = (loss_sum[0] / loss_sum[1].clamp(min=1)).item()

        metrics = {"train/loss": train_loss, "lr": sched.get_last_lr()[0], "epoch_time": time.time() - t0}
        if (epoch + 1) % args.val_every == 0:
            model.eval()
            with torch.no_grad():
                for batch in val_loader:
                    img = batch["image"].to(dev)
                    with torch.autocast(device_type="cuda", dtype=torch.float16):
                        pred = sliding_window_inference(img, args.patch, 4, lambda x: model.module(x)[0],
                                                        overlap=0.25)
                    batch["pred"] = pred.float()
                    batch["label"] = batch["label"].to(dev)
                    items = [post(i) for i in decollate_batch({"pred": batch["pred"], "label": batch["label"]})]
                    dice(y_pred=[i["pred"] for i in items], y=[i["label"] for i in items])
            liver, tumor = dice.aggregate().tolist()
            dice.reset()
            metrics.update({"val/dice_liver": liver, "val/dice_tumor": tumor})
            if rank == 0 and tumor > best_tumor:
                best_tumor = tumor
                torch.save({"epoch": epoch, "model": model.module.state_dict(), "dice_tumor": tumor},
                           os.path.join(out_dir, "best_tumor.pt"))
        if rank == 0:
            log.info("epoch %d %s", epoch, {k: round(v, 4) for k, v in metrics.items()})
            run.log(metrics, step=epoch)
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "scaler": scaler.state_dict()},
                       os.path.join(out_dir, "last.pt"))

    if run is not None:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
