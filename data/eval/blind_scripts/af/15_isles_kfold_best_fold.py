"""
ISLES'22 ischemic stroke lesion segmentation (DWI + ADC), 5-fold cross-validation in one job.
For each fold the best epoch is kept; at the end the best fold's weights are copied to
<out>/best_fold_model.pt for the ensemble / inference pipeline.

    torchrun --nproc_per_node=4 15_isles_kfold_best_fold.py --data /data/ISLES22_prep --out runs/isles_cv
"""
import argparse
import json
import os
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist
from sklearn.model_selection import KFold
from torch.nn.parallel import DistributedDataParallel as DDP

from monai.data import CacheDataset, DataLoader, DistributedSampler
from monai.inferers import sliding_window_inference
from monai.losses import DiceFocalLoss
from monai.metrics import compute_dice
from monai.networks.nets import UNet
from monai.transforms import (Compose, ConcatItemsd, EnsureChannelFirstd, LoadImaged, NormalizeIntensityd,
                              RandCropByPosNegLabeld, RandFlipd, RandRotate90d, RandScaleIntensityd, SpatialPadd)

PATCH = (96, 96, 64)


def cli():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/ISLES22_prep")
    ap.add_argument("--out", default="runs/isles_cv")
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=250)
    ap.add_argument("--val_every", type=int, default=5)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--seed", type=int, default=7)
    return ap.parse_args()


def transforms():
    keys = ["dwi", "adc", "label"]
    base = [LoadImaged(keys=keys), EnsureChannelFirstd(keys=keys),
            NormalizeIntensityd(keys=["dwi", "adc"], nonzero=True),
            ConcatItemsd(keys=["dwi", "adc"], name="image"), SpatialPadd(keys=["image", "label"], spatial_size=PATCH)]
    train = Compose(base + [
        RandCropByPosNegLabeld(keys=["image", "label"], label_key="label", spatial_size=PATCH, pos=3, neg=1,
                               num_samples=2),
        RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=0),
        RandRotate90d(keys=["image", "label"], prob=0.3, spatial_axes=(0, 1)),
        RandScaleIntensityd(keys="image", factors=0.1, prob=0.3),
    ])
    return train, Compose(base)


def run_fold(fold, train_items, val_items, args, rank, world, device):
    train_tf, val_tf = transforms()
    train_ds = CacheDataset(train_items, train_tf, cache_rate=1.0, num_workers=8, progress=False)
    val_ds = CacheDataset(val_items, val_tf, cache_rate=1.0, num_workers=8, progress=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, even_divisible=False)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=6, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=1, sampler=val_sampler, num_workers=2)

    torch.manual_seed(args.seed + fold)
    net = UNet(spatial_dims=3, in_channels=2, out_channels=2, channels=(32, 64, 128, 256, 320),
               strides=(2, 2, 2, 2), num_res_units=2, norm="instance", dropout=0.1).to(device)
    model = DDP(net, device_ids=[device.index])
    loss_fn = DiceFocalLoss(to_onehot_y=True, softmax=True, include_background=False, lambda_focal=0.5)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(train_loader),
                                                pct_start=0.05)
    scaler = torch.cuda.amp.GradScaler()

    fold_dir = os.path.join(args.out, f"fold{fold}")
    best_dice, best_epoch = -1.0, -1
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for batch in train_loader:
            x, y = batch["image"].to(device, non_blocking=True), batch["label"].to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            with torch.cuda.amp.autocast():
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()

        if (epoch + 1) % args.val_every:
            continue
        net.eval()
        case_dice = []
        with torch.no_grad():
            for batch in val_loader:
                x, y = batch["image"].to(device), batch["label"].to(device)
                with torch.cuda.amp.autocast():
                    logits = sliding_window_inference(x, PATCH, 4, net, overlap=0.5)
                pred = logits.argmax(1, keepdim=True)
                d = compute_dice((pred == 1).float(), (y == 1).float(), include_background=True,
                                 ignore_empty=False)
                case_dice.append(d.item())
        mean_dice = float(np.mean(case_dice))
        if rank == 0:
            print(f"[fold {fold}] epoch {epoch + 1} loss {loss.item():.4f} val dice {mean_dice:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if mean_dice > best_dice:
                best_dice, best_epoch = mean_dice, epoch + 1
                torch.save({"state_dict": net.state_dict(), "epoch": epoch + 1, "dice": mean_dice},
                           os.path.join(fold_dir, "best.pt"))
    dist.barrier()
    return best_dice, best_epoch


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    cases = sorted(d for d in os.listdir(args.data) if d.startswith("sub-strokecase"))
    items = [{"dwi": os.path.join(args.data, c, "dwi.nii.gz"), "adc": os.path.join(args.data, c, "adc.nii.gz"),
              "label": os.path.join(args.data, c, "msk.nii.gz"), "id": c} for c in cases]
    kf = KFold(n_splits=args.folds, shuffle=True, random_state=args.seed)
    splits = list(kf.split(items))
    if rank == 0:
        for f in range(args.folds):
            os.makedirs(os.path.join(args.out, f"fold{f}"), exist_ok=True)
        with open(os.path.join(args.out, "splits.json"), "w") as fh:
            json.dump([{"train": [items[i]["id"] for i in tr], "val": [items[i]["id"] for i in va]}
                       for tr, va in splits], fh, indent=1)
    dist.barrier()

    results = {}
    for fold, (tr, va) in enumerate(splits):
        best_dice, best_epoch = run_fold(fold, [items[i] for i in tr], [items[i] for i in va], args, rank, world,
                                         device)
        results[fold] = {"dice": best_dice, "epoch": best_epoch}

    if rank == 0:
        best_fold = max(results, key=lambda f: results[f]["dice"])
        shutil.copyfile(os.path.join(args.out, f"fold{best_fold}", "best.pt"),
                        os.path.join(args.out, "best_fold_model.pt"))
        dices = [r["dice"] for r in results.values()]
        summary = {"folds": results, "mean": float(np.mean(dices)), "std": float(np.std(dices)),
                   "best_fold": best_fold}
        with open(os.path.join(args.out, "cv_summary.json"), "w") as fh:
            json.dump(summary, fh, indent=2)
        print(json.dumps(summary, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
