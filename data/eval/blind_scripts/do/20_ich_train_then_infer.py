"""Intracranial haemorrhage segmentation on non-contrast head CT (INSTANCE 2022 data
+ our retrospective cohort). Trains a 3D UNet with DDP, then predicts the held-out
test set with the best checkpoint and writes NIfTI masks for the radiologists.

    torchrun --standalone --nproc_per_node=4 20_ich_train_then_infer.py --out /mnt/research/ich/run07
"""
import argparse
import glob
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from monai.data import CacheDataset, DataLoader, Dataset, decollate_batch, partition_dataset
from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.metrics import DiceMetric
from monai.networks.nets import UNet
from monai.transforms import (
    Activationsd,
    AsDiscrete,
    AsDiscreted,
    Compose,
    EnsureChannelFirstd,
    EnsureTyped,
    Invertd,
    LoadImaged,
    Orientationd,
    RandAffined,
    RandCropByPosNegLabeld,
    RandFlipd,
    SaveImaged,
    ScaleIntensityRanged,
    Spacingd,
)

PATCH = (192, 192, 32)
SPACING = (0.45, 0.45, 5.0)


def build_net():
    return UNet(spatial_dims=3, in_channels=1, out_channels=2, channels=(32, 64, 128, 256),
                strides=((2, 2, 1), (2, 2, 2), (2, 2, 2)), num_res_units=2, norm="instance")


def pairs(folder):
    imgs = sorted(glob.glob(os.path.join(folder, "data", "*.nii.gz")))
    return [{"image": p, "label": p.replace("/data/", "/label/")} for p in imgs]


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_dir", default="/mnt/research/ich/train")
    ap.add_argument("--val_dir", default="/mnt/research/ich/val")
    ap.add_argument("--test_dir", default="/mnt/research/ich/test/data")
    ap.add_argument("--out", default="/mnt/research/ich/run")
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--val_every", type=int, default=10)
    ap.add_argument("--resume", action="store_true")
    return ap.parse_args()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    ckpt_dir = os.path.join(args.out, "checkpoints")
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
    dist.barrier()

    base = [
        LoadImaged(keys=["image", "label"]),
        EnsureChannelFirstd(keys=["image", "label"]),
        Orientationd(keys=["image", "label"], axcodes="RAS"),
        Spacingd(keys=["image", "label"], pixdim=SPACING, mode=("bilinear", "nearest")),
        ScaleIntensityRanged(keys="image", a_min=0, a_max=80, b_min=0.0, b_max=1.0, clip=True),  # brain window
        EnsureTyped(keys=["image", "label"]),
    ]
    train_tf = Compose(base + [
        RandCropByPosNegLabeld(keys=["image", "label"], label_key="label", spatial_size=PATCH, pos=1, neg=1,
                               num_samples=2),
        RandAffined(keys=["image", "label"], prob=0.3, rotate_range=(0, 0, 0.3), scale_range=(0.1, 0.1, 0),
                    mode=("bilinear", "nearest")),
        RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=0),
    ])
    val_tf = Compose(base)

    train_ds = CacheDataset(pairs(args.train_dir), train_tf, cache_rate=1.0, num_workers=8)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=4, pin_memory=True)
    val_part = partition_dataset(pairs(args.val_dir), num_partitions=world, even_divisible=False)[rank]
    val_loader = DataLoader(Dataset(val_part, val_tf), batch_size=1, num_workers=2)

    model = DDP(build_net().to(device), device_ids=[local_rank])
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    metric = DiceMetric(include_background=False, reduction="mean")
    post_pred, post_lab = AsDiscrete(argmax=True, to_onehot=2), AsDiscrete(to_onehot=2)

    start, best = 0, 0.0
    last_path, best_path = os.path.join(ckpt_dir, "last.pt"), os.path.join(ckpt_dir, "best.pt")
    if args.resume and os.path.exists(last_path):
        ck = torch.load(last_path, map_location=device)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start, best = ck["epoch"], ck["best"]

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for batch in train_loader:
            x, y = batch["image"].to(device), batch["label"].to(device)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(acc)
        if rank == 0:
            print(f"[{epoch + 1}/{args.epochs}] loss {(acc[0] / acc[1]).item():.4f} ({time.time() - t0:.0f}s)",
                  flush=True)

        if (epoch + 1) % args.val_every == 0:
            model.eval()
            with torch.no_grad():
                for batch in val_loader:
                    x, y = batch["image"].to(device), batch["label"].to(device)
                    out = sliding_window_inference(x, PATCH, 4, model.module, overlap=0.5)
                    metric(y_pred=[post_pred(o) for o in decollate_batch(out)],
                           y=[post_lab(t) for t in decollate_batch(y)])
            dice = metric.aggregate().item()
            metric.reset()
            if rank == 0:
                print(f"    val dice {dice:.4f}", flush=True)
                if dice > best:
                    best = dice
                    torch.save(model.state_dict(), best_path)
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                            "epoch": epoch + 1, "best": max(best, dice)}, last_path)
            best = max(best, dice)
            dist.barrier()

    # ---- inference on the held-out test set with the best checkpoint ----
    test_files = [{"image": p} for p in sorted(glob.glob(os.path.join(args.test_dir, "*.nii.gz")))]
    test_part = partition_dataset(test_files, num_partitions=world, even_divisible=False)[rank]
    test_tf = Compose([
        LoadImaged(keys="image"),
        EnsureChannelFirstd(keys="image"),
        Orientationd(keys="image", axcodes="RAS"),
        Spacingd(keys="image", pixdim=SPACING, mode="bilinear"),
        ScaleIntensityRanged(keys="image", a_min=0, a_max=80, b_min=0.0, b_max=1.0, clip=True),
        EnsureTyped(keys="image"),
    ])
    post_tf = Compose([
        Activationsd(keys="pred", softmax=True),
        Invertd(keys="pred", transform=test_tf, orig_keys="image", nearest_interp=False, to_tensor=True),
        AsDiscreted(keys="pred", argmax=True),
        SaveImaged(keys="pred", output_dir=os.path.join(args.out, "test_pred"), output_postfix="ich",
                   resample=False, separate_folder=False),
    ])
    infer_net = build_net().to(device)
    infer_net.load_state_dict(torch.load(best_path, map_location=device))
    infer_net.eval()
    test_loader = DataLoader(Dataset(test_part, test_tf), batch_size=1, num_workers=2)
    with torch.no_grad():
        for batch in test_loader:
            batch["pred"] = sliding_window_inference(batch["image"].to(device), PATCH, 4, infer_net, overlap=0.5)
            for item in decollate_batch(batch):
                post_tf(item)
    dist.barrier()
    if rank == 0:
        print(f"predictions written to {os.path.join(args.out, 'test_pred')}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
