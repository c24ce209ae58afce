"""
FLARE22 abdominal organ segmentation, one fold of 5-fold CV per Slurm job.
Processes are started by srun (one task per GPU); rank / world size come from Slurm.

    sbatch --nodes=2 --ntasks-per-node=4 --gpus-per-node=4 --cpus-per-task=8 --time=48:00:00 \
        --wrap "srun python 18_flare_kfold_slurm_hd95.py --fold 0 --out /project/exp/flare_cv"

Per-fold results are written to <out>/fold<k>/result.json and summarised by collect_cv.py.
"""
import argparse
import json
import os
import subprocess
import time
from glob import glob

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.model_selection import KFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from monai.data import CacheDataset, DataLoader, DistributedSampler, decollate_batch
from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.metrics import DiceMetric, HausdorffDistanceMetric
from monai.networks.blocks import UnetBasicBlock, UnetOutBlock, UnetUpBlock
from monai.transforms import (AsDiscrete, Compose, CropForegroundd, EnsureChannelFirstd, EnsureTyped, LoadImaged,
                              Orientationd, RandCropByPosNegLabeld, RandFlipd, RandScaleIntensityd, ScaleIntensityRanged,
                              Spacingd, SpatialPadd)

N_CLS = 14
PATCH = (160, 160, 96)


class CkptUNet(nn.Module):
    def __init__(self, feats=(32, 64, 128, 256, 320)):
        super().__init__()
        norm = ("instance", {"affine": True})
        self.enc = nn.ModuleList([UnetBasicBlock(3, 1 if i == 0 else feats[i - 1], f, 3, 1 if i == 0 else 2,
                                                 norm_name=norm) for i, f in enumerate(feats)])
        self.dec = nn.ModuleList([UnetUpBlock(3, feats[i], feats[i - 1], 3, 2, 2, norm_name=norm)
                                  for i in range(len(feats) - 1, 0, -1)])
        self.out = UnetOutBlock(3, feats[0], N_CLS)

    def forward(self, x):
        skips = []
        for blk in self.enc:
            x = checkpoint(blk, x, use_reentrant=False) if self.training else blk(x)
            skips.append(x)
        x = skips.pop()
        for blk in self.dec:
            s = skips.pop()
            x = checkpoint(blk, x, s, use_reentrant=False) if self.training else blk(x, s)
        return self.out(x)


def slurm_env():
    rank = int(os.environ["SLURM_PROCID"])
    world = int(os.environ["SLURM_NTASKS"])
    local = int(os.environ["SLURM_LOCALID"])
    if "MASTER_ADDR" not in os.environ:
        hosts = subprocess.check_output(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]])
        os.environ["MASTER_ADDR"] = hosts.decode().split()[0]
    os.environ.setdefault("MASTER_PORT", str(12000 + int(os.environ["SLURM_JOB_ID"]) % 20000))
    # with --gpus-per-task each task sees a single device; with --gpus-per-node it sees all of them
    device_idx = 0 if torch.cuda.device_count() == 1 else local
    return rank, world, device_idx


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/project/data/FLARE22/labelled")
    ap.add_argument("--out", default="/project/exp/flare_cv")
    ap.add_argument("--fold", type=int, required=True)
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--base_lr", type=float, default=1e-4, help="for a global batch of 8")
    ap.add_argument("--val_every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=2022)
    return ap.parse_args()


def main():
    args = parse()
    rank, world, dev_idx = slurm_env()
    torch.cuda.set_device(dev_idx)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world)
    device = torch.device("cuda", dev_idx)

    imgs = sorted(glob(os.path.join(args.data, "images", "*_0000.nii.gz")))
    items = [{"image": p, "label": p.replace("images", "labels").replace("_0000.nii.gz", ".nii.gz")} for p in imgs]
    kf = KFold(n_splits=args.folds, shuffle=True, random_state=args.seed)
    tr_idx, va_idx = list(kf.split(items))[args.fold]
    fold_dir = os.path.join(args.out, f"fold{args.fold}")
    if rank == 0:
        os.makedirs(fold_dir, exist_ok=True)

    keys = ["image", "label"]
    pre = [LoadImaged(keys=keys), EnsureChannelFirstd(keys=keys), Orientationd(keys=keys, axcodes="RAS"),
           Spacingd(keys=keys, pixdim=(1.5, 1.5, 2.5), mode=("bilinear", "nearest")),
           ScaleIntensityRanged(keys="image", a_min=-325, a_max=325, b_min=0, b_max=1, clip=True),
           CropForegroundd(keys=keys, source_key="image"), EnsureTyped(keys=keys, track_meta=False)]
    train_tf = Compose(pre + [SpatialPadd(keys=keys, spatial_size=PATCH),
                              RandCropByPosNegLabeld(keys=keys, label_key="label", spatial_size=PATCH, pos=2,
                                                     neg=1, num_samples=2),
                              RandFlipd(keys=keys, prob=0.5, spatial_axis=0),
                              RandScaleIntensityd(keys="image", factors=0.1, prob=0.3)])
    train_ds = CacheDataset([items[i] for i in tr_idx], train_tf, cache_rate=1.0, num_workers=8, progress=False)
    val_ds = CacheDataset([items[i] for i in va_idx], Compose(pre), cache_rate=1.0, num_workers=8, progress=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=6, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=1, sampler=DistributedSampler(val_ds, shuffle=False,
                                                                            even_divisible=False), num_workers=2)

    model = CkptUNet().to(device)
    model = DDP(model, device_ids=[dev_idx])
    lr = args.base_lr * args.bs * world / 8
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    scaler = torch.cuda.amp.GradScaler()
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True)
    dice_m = DiceMetric(include_background=False, reduction="mean_batch")
    hd_m = HausdorffDistanceMetric(include_background=False, percentile=95, reduction="mean_batch")
    to_pred, to_lbl = AsDiscrete(argmax=True, to_onehot=N_CLS), AsDiscrete(to_onehot=N_CLS)

    best = {"dice": -1.0, "hd95": None, "epoch": -1}
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, tot = time.time(), torch.zeros(2, device=device)
        for batch in train_loader:
            x, y = batch["image"].to(device), batch["label"].to(device)
            opt.zero_grad(set_to_none=True)
            with torch.cuda.amp.autocast():
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(tot)
        if rank == 0:
            print(f"[fold {args.fold}] ep {epoch} loss {(tot[0] / tot[1]).item():.4f} lr {lr:.2e} "
                  f"{time.time() - t0:.0f}s", flush=True)

        if (epoch + 1) % args.val_every:
            continue
        net = model.module
        net.eval()
        with torch.no_grad():
            for batch in val_loader:
                x, y = batch["image"].to(device), batch["label"].to(device)
                with torch.cuda.amp.autocast():
                    out = sliding_window_inference(x, PATCH, 4, net, overlap=0.5)
                preds = [to_pred(o) for o in decollate_batch(out.float())]
                gts = [to_lbl(t) for t in decollate_batch(y)]
                dice_m(y_pred=preds, y=gts)
                hd_m(y_pred=preds, y=gts)
        # both metrics all-gather the per-case values of every rank before reducing
        organ_dice = dice_m.aggregate()
        organ_hd = hd_m.aggregate()
        dice_m.reset()
        hd_m.reset()
        mean_dice, mean_hd = organ_dice.nanmean().item(), organ_hd.nanmean().item()
        if rank == 0:
            print(f"  dice {mean_dice:.4f} hd95 {mean_hd:.2f}", flush=True)
            if mean_dice > best["dice"]:
                best = {"dice": mean_dice, "hd95": mean_hd, "epoch": epoch,
                        "organ_dice": organ_dice.tolist(), "organ_hd95": organ_hd.tolist()}
                torch.save({"state_dict": net.state_dict(), "fold": args.fold, **best},
                           os.path.join(fold_dir, "best.pt"))
                with open(os.path.join(fold_dir, "result.json"), "w") as f:
                    json.dump(best, f, indent=2)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
