# KiTS21 kidney / tumor / cyst segmentation with DynUNet, class-balanced patch sampling.
# Launch: torchrun --standalone --nproc_per_node=4 04_kits_dynunet_patches.py --config configs/kits21.yaml
import argparse
import logging
import os
import random
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter

from monai.data import CacheDataset, DataLoader, Dataset, DistributedSampler, decollate_batch, load_decathlon_datalist
from monai.inferers import SlidingWindowInferer
from monai.losses import DiceCELoss
from monai.metrics import compute_dice
from monai.networks.nets import DynUNet
from monai.transforms import (
    AsDiscrete,
    Compose,
    CropForegroundd,
    EnsureChannelFirstd,
    LoadImaged,
    Orientationd,
    RandCropByLabelClassesd,
    RandFlipd,
    RandGaussianNoised,
    RandScaleIntensityd,
    RandZoomd,
    ScaleIntensityRanged,
    Spacingd,
    SpatialPadd,
)

DEFAULTS = dict(
    data_json="/data/kits21/dataset_5fold.json",
    data_root="/data/kits21",
    fold=0,
    out_dir="./runs/kits21_dynunet",
    patch=[128, 128, 128],
    spacing=[0.78, 0.78, 1.0],
    batch_size=2,
    num_samples=2,
    epochs=1000,
    val_every=20,
    lr=1e-2,
    weight_decay=3e-5,
    num_workers=8,
    cache_rate=1.0,
    ratios=[1, 1, 1, 1],
)


def load_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--fold", type=int, default=None)
    a = ap.parse_args()
    cfg = dict(DEFAULTS)
    if a.config:
        with open(a.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    if a.fold is not None:
        cfg["fold"] = a.fold
    return argparse.Namespace(**cfg)


def build_transforms(cfg):
    keys = ["image", "label"]
    base = [
        LoadImaged(keys=keys),
        EnsureChannelFirstd(keys=keys),
        Orientationd(keys=keys, axcodes="RAS"),
        Spacingd(keys=keys, pixdim=cfg.spacing, mode=("bilinear", "nearest")),
        ScaleIntensityRanged(keys="image", a_min=-80, a_max=305, b_min=-1.0, b_max=1.0, clip=True),
        CropForegroundd(keys=keys, source_key="image"),
    ]
    train = Compose(base + [
        SpatialPadd(keys=keys, spatial_size=cfg.patch),
        RandCropByLabelClassesd(keys=keys, label_key="label", spatial_size=cfg.patch, ratios=cfg.ratios,
                                num_classes=4, num_samples=cfg.num_samples),
        RandZoomd(keys=keys, min_zoom=0.9, max_zoom=1.2, mode=("trilinear", "nearest"), prob=0.2),
        RandFlipd(keys=keys, spatial_axis=[0], prob=0.5),
        RandFlipd(keys=keys, spatial_axis=[1], prob=0.5),
        RandFlipd(keys=keys, spatial_axis=[2], prob=0.5),
        RandGaussianNoised(keys="image", std=0.01, prob=0.15),
        RandScaleIntensityd(keys="image", factors=0.1, prob=0.5),
    ])
    val = Compose(base)
    return train, val


def get_kernels_strides(patch, spacing):
    sizes, spacings = list(patch), list(spacing)
    strides, kernels = [], []
    while True:
        ratios = [sp / min(spacings) for sp in spacings]
        stride = [2 if r <= 2 and s >= 8 else 1 for r, s in zip(ratios, sizes)]
        kernel = [3 if r <= 2 else 1 for r in ratios]
        if all(s == 1 for s in stride):
            break
        sizes = [i // j for i, j in zip(sizes, stride)]
        spacings = [i * j for i, j in zip(spacings, stride)]
        kernels.append(kernel)
        strides.append(stride)
    strides.insert(0, len(spacings) * [1])
    kernels.append(len(spacings) * [3])
    return kernels, strides


def main():
    cfg = load_cfg()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    random.seed(1234 + rank)
    np.random.seed(1234 + rank)
    torch.manual_seed(1234 + rank)

    log = logging.getLogger("kits")
    logging.basicConfig(stream=sys.stdout, level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(message)s")
    writer = SummaryWriter(os.path.join(cfg.out_dir, f"fold{cfg.fold}", "tb")) if rank == 0 else None

    train_files = load_decathlon_datalist(cfg.data_json, True, f"fold{cfg.fold}_train", base_dir=cfg.data_root)
    val_files = load_decathlon_datalist(cfg.data_json, True, f"fold{cfg.fold}_val", base_dir=cfg.data_root)
    train_tf, val_tf = build_transforms(cfg)

    train_ds = CacheDataset(train_files, train_tf, cache_rate=cfg.cache_rate, num_workers=cfg.num_workers)
    val_ds = Dataset(val_files, val_tf)
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True)
    val_sampler = DistributedSampler(val_ds, even_divisible=False, num_replicas=world, rank=rank, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=train_sampler,
                              num_workers=cfg.num_workers, pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=1, sampler=val_sampler, num_workers=4)

    kernels, strides = get_kernels_strides(cfg.patch, cfg.spacing)
    net = DynUNet(spatial_dims=3, in_channels=1, out_channels=4, kernel_size=kernels, strides=strides,
                  upsample_kernel_size=strides[1:], norm_name="instance", res_block=True).to(device)
    model = DDP(net, device_ids=[local_rank])

    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True, batch=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.99, nesterov=True,
                                weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: (1 - e / cfg.epochs) ** 0.9)
    scaler = torch.cuda.amp.GradScaler()
    inferer = SlidingWindowInferer(roi_size=cfg.patch, sw_batch_size=4, overlap=0.5, mode="gaussian")
    to_onehot = AsDiscrete(to_onehot=4)
    to_pred = AsDiscrete(argmax=True, to_onehot=4)

    best = -1.0
    ckpt_dir = os.path.join(cfg.out_dir, f"fold{cfg.fold}")
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
    for epoch in range(cfg.epochs):
        model.train()
        t0 = time.time()
        run_loss = torch.zeros(1, device=device)
        n = 0
        for batch in train_loader:
            x = batch["image"].to(device, non_blocking=True)
            y = batch["label"].to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.cuda.amp.autocast():
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 12.0)
            scaler.step(optimizer)
            scaler.update()
            run_loss += loss.detach()
            n += 1
        scheduler.step()
        dist.all_reduce(run_loss)
        run_loss = run_loss.item() / (n * world)
        log.info("ep %d loss %.4f lr %.5f %.0fs", epoch, run_loss, optimizer.param_groups[0]["lr"], time.time() - t0)
        if writer:
            writer.add_scalar("loss/train", run_loss, epoch)

        if (epoch + 1) % cfg.val_every:
            continue
        model.eval()
        sums = torch.zeros(4, device=device)  # kidney, tumor, cyst dice sums + case count
        with torch.no_grad(), torch.cuda.amp.autocast():
            for batch in val_loader:
                x, y = batch["image"].to(device), batch["label"].to(device)
                logits = inferer(x, model)
                pred = torch.stack([to_pred(p) for p in decollate_batch(logits)])
                gt = torch.stack([to_onehot(t) for t in decollate_batch(y)])
                d = compute_dice(pred, gt, include_background=False, ignore_empty=False)
                sums[:3] += torch.nan_to_num(d[0].float(), nan=0.0)
                sums[3] += 1
        dist.all_reduce(sums)
        dice = (sums[:3] / sums[3]).tolist()
        mean_dice = float(np.mean(dice))
        if rank == 0:
            log.info("ep %d val dice kidney %.4f tumor %.4f cyst %.4f mean %.4f", epoch, *dice, mean_dice)
            writer.add_scalar("dice/mean", mean_dice, epoch)
            state = {"epoch": epoch, "model": model.module.state_dict(), "opt": optimizer.state_dict(),
                     "sched": scheduler.state_dict(), "best": max(best, mean_dice)}
            torch.save(state, os.path.join(ckpt_dir, "last.pt"))
            if mean_dice > best:
                torch.save(state, os.path.join(ckpt_dir, "best.pt"))
        best = max(best, mean_dice)
        dist.barrier()

    if writer:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
