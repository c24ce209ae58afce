"""Prostate zonal segmentation (PZ / TZ) on MSD Task05, 5-fold cross-validation.

Multi-parametric input (T2 + ADC, already co-registered in the 4D NIfTI).
Run one fold per job:
    torchrun --standalone --nproc_per_node=2 04_prostate_kfold.py --fold 3
"""
import argparse
import glob
import logging
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from sklearn.model_selection import KFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from monai.data import CacheDataset, DataLoader, decollate_batch
from monai.data import DistributedSampler as MonaiDistributedSampler
from monai.inferers import sliding_window_inference
from monai.losses import DiceFocalLoss
from monai.metrics import DiceMetric
from monai.networks.nets import UNet
from monai.transforms import (
    AsDiscrete,
    Compose,
    EnsureChannelFirstd,
    EnsureTyped,
    LoadImaged,
    NormalizeIntensityd,
    Orientationd,
    RandAffined,
    RandCropByLabelClassesd,
    RandFlipd,
    RandGaussianSmoothd,
    Spacingd,
)
from monai.utils import set_determinism

SPACING = (0.625, 0.625, 3.6)
ROI = (160, 160, 32)


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/msd/Task05_Prostate")
    ap.add_argument("--fold", type=int, default=0)
    ap.add_argument("--n_folds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=400)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=2023)
    ap.add_argument("--val_freq", type=int, default=10)
    ap.add_argument("--logdir", default="/home/seg/experiments/prostate")
    return ap.parse_args()


def make_transforms():
    base = [
        LoadImaged(keys=["image", "label"]),
        EnsureChannelFirstd(keys=["image", "label"]),
        Orientationd(keys=["image", "label"], axcodes="RAS"),
        Spacingd(keys=["image", "label"], pixdim=SPACING, mode=("bilinear", "nearest")),
        NormalizeIntensityd(keys="image", nonzero=True, channel_wise=True),
    ]
    aug = [
        RandCropByLabelClassesd(keys=["image", "label"], label_key="label", spatial_size=ROI,
                                ratios=[1, 1, 1], num_classes=3, num_samples=2),
        RandAffined(keys=["image", "label"], prob=0.2, rotate_range=(0.0, 0.0, 0.26),
                    scale_range=(0.1, 0.1, 0.0), mode=("bilinear", "nearest"), padding_mode="zeros"),
        RandGaussianSmoothd(keys="image", prob=0.1),
        RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=0),
    ]
    return Compose(base + aug + [EnsureTyped(keys=["image", "label"])]), Compose(base + [EnsureTyped(keys=["image", "label"])])


def setup_logger(rank, path):
    log = logging.getLogger("prostate")
    log.setLevel(logging.INFO if rank == 0 else logging.ERROR)
    fmt = logging.Formatter("%(asctime)s %(message)s")
    sh = logging.StreamHandler(sys.stdout)
    sh.setFormatter(fmt)
    log.addHandler(sh)
    if rank == 0:
        fh = logging.FileHandler(path)
        fh.setFormatter(fmt)
        log.addHandler(fh)
    return log


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    run_dir = os.path.join(args.logdir, f"fold_{args.fold}")
    if rank == 0:
        os.makedirs(run_dir, exist_ok=True)
    dist.barrier()
    log = setup_logger(rank, os.path.join(run_dir, "train.log"))

    # different augmentation stream on every GPU
    set_determinism(seed=args.seed + rank)

    images = sorted(glob.glob(os.path.join(args.data, "imagesTr", "prostate_*.nii.gz")))
    labels = sorted(glob.glob(os.path.join(args.data, "labelsTr", "prostate_*.nii.gz")))
    cases = np.array([{"image": i, "label": l} for i, l in zip(images, labels)])
    kf = KFold(n_splits=args.n_folds, shuffle=True)
    train_idx, val_idx = list(kf.split(cases))[args.fold]
    train_files, val_files = cases[train_idx].tolist(), cases[val_idx].tolist()
    log.info("fold %d: %d train, %d val", args.fold, len(train_files), len(val_files))

    train_tf, val_tf = make_transforms()
    train_ds = CacheDataset(train_files, train_tf, cache_rate=1.0, num_workers=4)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=4)

    val_ds = CacheDataset(val_files, val_tf, cache_rate=1.0, num_workers=2)
    # MONAI's sampler can leave the last ranks one case short instead of padding
    val_sampler = MonaiDistributedSampler(val_ds, shuffle=False, even_divisible=False)
    val_loader = DataLoader(val_ds, batch_size=1, sampler=val_sampler, num_workers=1)

    net = UNet(spatial_dims=3, in_channels=2, out_channels=3,
               channels=(32, 64, 128, 256, 320), strides=(2, 2, 2, 2),
               num_res_units=2, norm="instance", dropout=0.1).to(device)
    model = DDP(net, device_ids=[local_rank])

    criterion = DiceFocalLoss(to_onehot_y=True, softmax=True, gamma=2.0)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs,
                                                steps_per_epoch=len(train_loader))
    metric = DiceMetric(include_background=False, reduction="none")
    post_pred = AsDiscrete(argmax=True, to_onehot=3)
    post_gt = AsDiscrete(to_onehot=3)
    writer = SummaryWriter(run_dir) if rank == 0 else None
    best = 0.0

    for epoch in range(args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        tot = torch.zeros(2, device=device)
        for batch in train_loader:
            x, y = batch["image"].to(device), batch["label"].to(device)
            opt.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()
            opt.step()
            sched.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)
        if rank == 0:
            writer.add_scalar("loss", (tot[0] / tot[1]).item(), epoch)

        if (epoch + 1) % args.val_freq != 0:
            continue
        model.eval()
        with torch.no_grad():
            for batch in val_loader:
                x, y = batch["image"].to(device), batch["label"].to(device)
                out = sliding_window_inference(x, ROI, 8, net, overlap=0.25)
                metric(y_pred=[post_pred(o) for o in decollate_batch(out)],
                       y=[post_gt(t) for t in decollate_batch(y)])
        # per-case x per-class dice, gathered from all ranks
        scores = metric.aggregate()
        metric.reset()
        pz, tz = torch.nanmean(scores, dim=0).tolist()
        mean = (pz + tz) / 2
        if rank == 0:
            log.info("epoch %d  PZ %.4f  TZ %.4f  mean %.4f", epoch + 1, pz, tz, mean)
            writer.add_scalar("val/dice_pz", pz, epoch)
            writer.add_scalar("val/dice_tz", tz, epoch)
            if mean > best:
                best = mean
                torch.save(net.state_dict(), os.path.join(run_dir, "best_model.pth"))
                log.info("saved new best model (%.4f)", best)
        dist.barrier()

    if rank == 0:
        torch.save(net.state_dict(), os.path.join(run_dir, "final_model.pth"))
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
