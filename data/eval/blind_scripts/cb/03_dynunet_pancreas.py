"""DynUNet (nnU-Net topology) for MSD Task07 Pancreas, 5-fold CV, DDP.

torchrun --nproc_per_node=8 03_dynunet_pancreas.py --root /data/msd/Task07_Pancreas --fold 1
"""
import argparse
import json
import logging
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data.distributed import DistributedSampler

from monai.data import DataLoader, Dataset, load_decathlon_datalist
from monai.inferers import SlidingWindowInferer
from monai.losses import DiceCELoss
from monai.networks.nets import DynUNet
from monai.transforms import (
    AsDiscrete,
    Compose,
    CropForegroundd,
    EnsureChannelFirstd,
    LoadImaged,
    NormalizeIntensityd,
    Orientationd,
    RandAdjustContrastd,
    RandCropByPosNegLabeld,
    RandFlipd,
    RandGaussianNoised,
    RandZoomd,
    ScaleIntensityRanged,
    Spacingd,
    SpatialPadd,
)

PATCH = (96, 160, 160)
SPACING = (2.5, 0.8, 0.8)


def get_kernels_strides(patch, spacing):
    """nnU-Net style: pool along an axis while its spacing is at most 2x the finest one."""
    sizes, spacings = list(patch), list(spacing)
    strides, kernels = [], []
    while True:
        ratio = [sp / min(spacings) for sp in spacings]
        stride = [2 if r <= 2 and s >= 8 else 1 for r, s in zip(ratio, sizes)]
        kernel = [3 if r <= 2 else 1 for r in ratio]
        if all(s == 1 for s in stride):
            break
        sizes = [s // st for s, st in zip(sizes, stride)]
        spacings = [sp * st for sp, st in zip(spacings, stride)]
        kernels.append(kernel)
        strides.append(stride)
    strides.insert(0, len(spacings) * [1])
    kernels.append(len(spacings) * [3])
    return kernels, strides


def transforms():
    base = [
        LoadImaged(keys=["image", "label"]),
        EnsureChannelFirstd(keys=["image", "label"]),
        Orientationd(keys=["image", "label"], axcodes="RAS"),
        Spacingd(keys=["image", "label"], pixdim=SPACING, mode=("bilinear", "nearest")),
        ScaleIntensityRanged(keys="image", a_min=-96, a_max=215, b_min=-96, b_max=215, clip=True),
        NormalizeIntensityd(keys="image", subtrahend=77.99, divisor=75.4),
        CropForegroundd(keys=["image", "label"], source_key="image"),
    ]
    train = Compose(base + [
        SpatialPadd(keys=["image", "label"], spatial_size=PATCH),
        RandCropByPosNegLabeld(keys=["image", "label"], label_key="label", spatial_size=PATCH,
                               pos=1, neg=2, num_samples=1, image_key="image", image_threshold=-96),
        RandZoomd(keys=["image", "label"], min_zoom=0.85, max_zoom=1.25, mode=("trilinear", "nearest"),
                  align_corners=(True, None), prob=0.2),
        RandGaussianNoised(keys="image", std=0.01, prob=0.15),
        RandAdjustContrastd(keys="image", gamma=(0.7, 1.5), prob=0.3),
        RandFlipd(keys=["image", "label"], spatial_axis=[0], prob=0.5),
        RandFlipd(keys=["image", "label"], spatial_axis=[1], prob=0.5),
        RandFlipd(keys=["image", "label"], spatial_axis=[2], prob=0.5),
    ])
    return train, Compose(base)


def dice_per_class(pred, gt, n_cls):
    out = []
    for c in range(1, n_cls):
        p, g = pred == c, gt == c
        denom = p.sum() + g.sum()
        out.append(float("nan") if g.sum() == 0 else float(2 * (p & g).sum() / denom))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--fold", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=1000)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--eval_interval", type=int, default=25)
    ap.add_argument("--num_workers", type=int, default=8)
    ap.add_argument("--ckpt_dir", default="checkpoints/pancreas")
    args = ap.parse_args()

    dist.init_process_group("nccl", init_method="env://")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    is_main = rank == 0

    logging.basicConfig(stream=sys.stdout, level=logging.INFO if is_main else logging.ERROR,
                        format="%(asctime)s %(message)s")
    log = logging.getLogger(__name__)

    # datalist_5fold.json holds the fixed split, each training item has a "fold" key
    datalist = load_decathlon_datalist(os.path.join(args.root, "datalist_5fold.json"), True,
                                       "training", base_dir=args.root)
    train_files = [d for d in datalist if d["fold"] != args.fold]
    val_files = [d for d in datalist if d["fold"] == args.fold]

    train_tf, val_tf = transforms()
    train_ds = Dataset(train_files, train_tf)
    val_ds = Dataset(val_files, val_tf)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=1, sampler=val_sampler, num_workers=2)

    kernels, strides = get_kernels_strides(PATCH, SPACING)
    net = DynUNet(
        spatial_dims=3, in_channels=1, out_channels=3,
        kernel_size=kernels, strides=strides, upsample_kernel_size=strides[1:],
        norm_name="instance", deep_supervision=True, deep_supr_num=2, res_block=True,
    ).to(device)
    model = DistributedDataParallel(net, device_ids=[local_rank])

    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.99, weight_decay=3e-5, nesterov=True)
    sched = torch.optim.lr_scheduler.PolynomialLR(opt, total_iters=args.epochs, power=0.9)
    scaler = torch.cuda.amp.GradScaler()
    criterion = DiceCELoss(to_onehot_y=True, softmax=True, batch=True)
    ds_weights = [0.5 ** i for i in range(3)]
    inferer = SlidingWindowInferer(roi_size=PATCH, sw_batch_size=2, overlap=0.5, mode="gaussian")
    argmax = AsDiscrete(argmax=True)

    best = -1.0
    os.makedirs(args.ckpt_dir, exist_ok=True)
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic, loss_sum, n = time.time(), 0.0, 0
        for batch in train_loader:
            image, label = batch["image"].to(device), batch["label"].to(device)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda"):
                preds = model(image)  # (B, 1 + deep_supr_num, C, D, H, W)
                loss = sum(w * criterion(preds[:, i], label) for i, w in enumerate(ds_weights))
                loss = loss / sum(ds_weights)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 12.0)
            scaler.step(opt)
            scaler.update()
            loss_sum += loss.item()
            n += 1
        sched.step()
        log.info(f"[{epoch}] loss={loss_sum / max(n, 1):.4f} lr={sched.get_last_lr()[0]:.6f} "
                 f"t={time.time() - tic:.0f}s")

        if (epoch + 1) % args.eval_interval != 0:
            continue

        net.eval()
        scores = []
        with torch.no_grad():
            for batch in val_loader:
                image = batch["image"].to(device)
                with torch.autocast("cuda"):
                    logits = inferer(image, net)
                pred = argmax(logits[0]).cpu().numpy()[0].astype(np.uint8)
                gt = batch["label"][0, 0].numpy().astype(np.uint8)
                scores.append(dice_per_class(pred, gt, 3))
        scores = np.array(scores)
        pancreas, tumour = np.nanmean(scores[:, 0]), np.nanmean(scores[:, 1])
        mean_dice = float(np.nanmean([pancreas, tumour]))
        log.info(f"[{epoch}] val pancreas={pancreas:.4f} tumour={tumour:.4f} mean={mean_dice:.4f}")

        if is_main:
            state = {"epoch": epoch, "state_dict": net.state_dict(), "optimizer": opt.state_dict(),
                     "scheduler": sched.state_dict(), "best": max(best, mean_dice)}
            torch.save(state, os.path.join(args.ckpt_dir, f"fold{args.fold}_last.pt"))
            if mean_dice > best:
                best = mean_dice
                torch.save(state, os.path.join(args.ckpt_dir, f"fold{args.fold}_best.pt"))
                log.info(f"new best {best:.4f}")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
