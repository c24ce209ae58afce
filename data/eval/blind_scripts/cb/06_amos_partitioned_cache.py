"""AMOS22 abdominal multi-organ CT segmentation (15 organs).

Every rank caches only its own partition of the training set in memory
(CacheDataset), following the MONAI DDP tutorials.

    torchrun --nproc_per_node=4 06_amos_partitioned_cache.py --data_root /data/amos22 --fold 3
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP

from monai.data import CacheDataset, DataLoader, Dataset, DistributedSampler, partition_dataset
from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.networks.nets import BasicUNet
from monai.transforms import (
    Compose,
    CropForegroundd,
    EnsureChannelFirstd,
    LoadImaged,
    Orientationd,
    RandCropByPosNegLabeld,
    RandFlipd,
    RandRotate90d,
    RandShiftIntensityd,
    ScaleIntensityRanged,
    Spacingd,
    SpatialPadd,
)

NUM_CLASSES = 16
PATCH = (96, 96, 96)


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data_root", required=True)
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--max_iters", type=int, default=60000)
    p.add_argument("--val_every_iters", type=int, default=2000)
    p.add_argument("--batch_size", type=int, default=2)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--out", default="out/amos")
    p.add_argument("--resume", default=None)
    p.add_argument("--wandb_project", default="amos-seg")
    return p.parse_args()


def transforms():
    pre = [
        LoadImaged(keys=["image", "label"]),
        EnsureChannelFirstd(keys=["image", "label"]),
        Orientationd(keys=["image", "label"], axcodes="RAS"),
        Spacingd(keys=["image", "label"], pixdim=(1.5, 1.5, 2.0), mode=("bilinear", "nearest")),
        ScaleIntensityRanged(keys="image", a_min=-991, a_max=362, b_min=0.0, b_max=1.0, clip=True),
        CropForegroundd(keys=["image", "label"], source_key="image"),
    ]
    rand = [
        SpatialPadd(keys=["image", "label"], spatial_size=PATCH),
        RandCropByPosNegLabeld(keys=["image", "label"], label_key="label", spatial_size=PATCH,
                               pos=1, neg=1, num_samples=2, image_key="image", image_threshold=0),
        RandFlipd(keys=["image", "label"], spatial_axis=[0], prob=0.1),
        RandFlipd(keys=["image", "label"], spatial_axis=[1], prob=0.1),
        RandFlipd(keys=["image", "label"], spatial_axis=[2], prob=0.1),
        RandRotate90d(keys=["image", "label"], prob=0.1, max_k=3),
        RandShiftIntensityd(keys="image", offsets=0.10, prob=0.5),
    ]
    return Compose(pre + rand), Compose(pre)


def per_case_dice(pred, gt):
    """pred, gt: integer label maps on the same device -> list of dice for classes present in gt."""
    res = [float("nan")] * (NUM_CLASSES - 1)
    for c in range(1, NUM_CLASSES):
        g = gt == c
        if g.any():
            p = pred == c
            res[c - 1] = (2.0 * (p & g).sum() / (p.sum() + g.sum())).item()
    return res


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)

    with open(os.path.join(args.data_root, "splits_5fold.json")) as f:
        split = json.load(f)[args.fold]
    mk = lambda c: {"image": os.path.join(args.data_root, "imagesTr", c + ".nii.gz"),
                    "label": os.path.join(args.data_root, "labelsTr", c + ".nii.gz")}
    train_files = [mk(c) for c in split["train"]]
    val_files = [mk(c) for c in split["val"]]

    train_tf, val_tf = transforms()
    # same seed on every rank -> disjoint partitions of one permutation
    part = partition_dataset(train_files, num_partitions=world, shuffle=True, seed=0, even_divisible=True)[rank]
    train_ds = CacheDataset(part, train_tf, cache_rate=1.0, num_workers=4)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=4,
                              pin_memory=True, persistent_workers=True)
    val_ds = Dataset(val_files, val_tf)
    val_sampler = DistributedSampler(val_ds, shuffle=False, even_divisible=False)
    val_loader = DataLoader(val_ds, batch_size=1, sampler=val_sampler, num_workers=2)

    net = BasicUNet(spatial_dims=3, in_channels=1, out_channels=NUM_CLASSES,
                    features=(32, 64, 128, 256, 320, 32), norm=("batch", {"affine": True}))
    net = torch.nn.SyncBatchNorm.convert_sync_batchnorm(net).to(dev)
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.99, nesterov=True, weight_decay=3e-5)
    scaler = torch.cuda.amp.GradScaler()

    it, best = 0, 0.0
    if args.resume:
        ck = torch.load(args.resume, map_location=dev)
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        scaler.load_state_dict(ck["scaler"])
        it, best = ck["iter"], ck["best"]

    model = DDP(net, device_ids=[local_rank], output_device=local_rank)
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True, lambda_dice=1.0, lambda_ce=1.0)

    run = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        run = wandb.init(project=args.wandb_project, name=f"basicunet_f{args.fold}", config=vars(args),
                         resume="allow")

    def poly_lr(i):
        return args.lr * (1 - i / args.max_iters) ** 0.9

    epoch = 0
    model.train()
    t0 = time.time()
    while it < args.max_iters:
        for step, batch in enumerate(train_loader):
            x = batch["image"].to(dev, non_blocking=True)
            y = batch["label"].to(dev, non_blocking=True)
            sync_now = (step + 1) % args.accum == 0
            ctx = model.no_sync() if not sync_now else torch.enable_grad()
            with ctx:
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = loss_fn(model(x), y) / args.accum
                scaler.scale(loss).backward()
            if not sync_now:
                continue

            for g in opt.param_groups:
                g["lr"] = poly_lr(it)
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 12.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            it += 1

            if rank == 0 and it % 50 == 0:
                run.log({"train/loss": loss.item() * args.accum, "lr": poly_lr(it),
                         "it_per_s": 50 / (time.time() - t0)}, step=it)
                t0 = time.time()

            if it % args.val_every_iters == 0 or it == args.max_iters:
                model.eval()
                local = []
                with torch.no_grad():
                    for vb in val_loader:
                        with torch.autocast("cuda", dtype=torch.float16):
                            logits = sliding_window_inference(vb["image"].to(dev), PATCH, 4, model.module,
                                                              overlap=0.5, mode="gaussian")
                        local.append(per_case_dice(logits.argmax(1)[0], vb["label"][0, 0].to(dev)))
                gathered = [None] * world
                dist.all_gather_object(gathered, local)
                model.train()
                if rank == 0:
                    allc = np.array([d for g in gathered for d in g])
                    organ_dice = np.nanmean(allc, axis=0)
                    mean_dice = float(np.nanmean(organ_dice))
                    run.log({"val/mean_dice": mean_dice, "val/n_cases": len(allc)}, step=it)
                    ck = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                          "scaler": scaler.state_dict(), "iter": it, "best": max(best, mean_dice)}
                    torch.save(ck, os.path.join(args.out, "last.pt"))
                    if mean_dice > best:
                        best = mean_dice
                        torch.save(ck, os.path.join(args.out, "best.pt"))
                    print(f"it {it}: val mean dice {mean_dice:.4f} (best {best:.4f})", flush=True)
                dist.barrier()
            if it >= args.max_iters:
                break
        epoch += 1

    if rank == 0:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
