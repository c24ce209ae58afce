"""HECKTOR 2022: head & neck primary tumour (GTVp) and lymph node (GTVn)
segmentation from co-registered PET/CT, residual 3D UNet with optional deep supervision.

    torchrun --standalone --nproc_per_node=4 15_hecktor_petct_unet.py --fold 0
"""
import argparse
import csv
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from monai.data import CacheDataset, DataLoader, Dataset, decollate_batch, partition_dataset
from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.metrics import DiceMetric
from monai.networks.blocks import UnetBasicBlock, UnetResBlock, UnetUpBlock
from monai.transforms import (
    AsDiscrete,
    Compose,
    ConcatItemsd,
    EnsureChannelFirstd,
    EnsureTyped,
    LoadImaged,
    NormalizeIntensityd,
    RandAffined,
    RandCropByPosNegLabeld,
    RandFlipd,
    ScaleIntensityRanged,
    Spacingd,
)

PATCH = (128, 128, 128)


class ResUNet(nn.Module):
    def __init__(self, in_ch=2, n_cls=3, feats=(32, 64, 128, 256, 320), deep_supervision=False):
        super().__init__()
        self.deep_supervision = deep_supervision
        norm = ("instance", {"affine": True})
        self.stem = UnetResBlock(3, in_ch, feats[0], kernel_size=3, stride=1, norm_name=norm)
        self.down = nn.ModuleList(
            UnetResBlock(3, feats[i], feats[i + 1], kernel_size=3, stride=2, norm_name=norm)
            for i in range(len(feats) - 1)
        )
        self.up = nn.ModuleList(
            UnetUpBlock(3, feats[i + 1], feats[i], kernel_size=3, stride=1, upsample_kernel_size=2,
                        norm_name=norm)
            for i in reversed(range(len(feats) - 1))
        )
        self.head = nn.Conv3d(feats[0], n_cls, 1)
        # auxiliary heads on the two coarser decoder levels (same layout as our older checkpoints)
        self.ds_heads = nn.ModuleList([nn.Conv3d(feats[1], n_cls, 1), nn.Conv3d(feats[2], n_cls, 1)])

    def forward(self, x):
        skips = [self.stem(x)]
        for blk in self.down:
            skips.append(blk(skips[-1]))
        y = skips.pop()
        dec = []
        for blk in self.up:
            y = blk(y, skips.pop())
            dec.append(y)
        out = self.head(y)
        if self.training and self.deep_supervision:
            aux = [h(d) for h, d in zip(self.ds_heads, [dec[-2], dec[-3]])]
            return [out] + [F.interpolate(a, size=out.shape[2:], mode="trilinear") for a in aux]
        return out


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/hecktor2022/resampled")
    ap.add_argument("--folds_csv", default="/data/hecktor2022/folds.csv")
    ap.add_argument("--fold", type=int, default=0)
    ap.add_argument("--out", default="/data/hecktor2022/runs/resunet")
    ap.add_argument("--epochs", type=int, default=400)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--deep_supervision", action="store_true")
    ap.add_argument("--val_every", type=int, default=10)
    return ap.parse_args()


def read_folds(root, csv_path, fold):
    train, val = [], []
    with open(csv_path) as f:
        for row in csv.DictReader(f):
            pid = row["PatientID"]
            item = {"ct": f"{root}/{pid}__CT.nii.gz", "pt": f"{root}/{pid}__PT.nii.gz",
                    "label": f"{root}/{pid}.nii.gz"}
            (val if int(row["fold"]) == fold else train).append(item)
    return train, val


def get_transforms():
    pre = [
        LoadImaged(keys=["ct", "pt", "label"]),
        EnsureChannelFirstd(keys=["ct", "pt", "label"]),
        Spacingd(keys=["ct", "pt", "label"], pixdim=(1.0, 1.0, 1.0), mode=("bilinear", "bilinear", "nearest")),
        ScaleIntensityRanged(keys="ct", a_min=-250, a_max=250, b_min=-1.0, b_max=1.0, clip=True),
        NormalizeIntensityd(keys="pt"),
        ConcatItemsd(keys=["ct", "pt"], name="image"),
        EnsureTyped(keys=["image", "label"]),
    ]
    aug = [
        RandCropByPosNegLabeld(keys=["image", "label"], label_key="label", spatial_size=PATCH, pos=1, neg=1,
                               num_samples=2),
        RandAffined(keys=["image", "label"], prob=0.3, rotate_range=(0.2, 0.2, 0.2), scale_range=(0.1,) * 3,
                    mode=("bilinear", "nearest")),
        RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=0),
    ]
    return Compose(pre + aug), Compose(pre)


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_files, val_files = read_folds(args.root, args.folds_csv, args.fold)
    train_tf, val_tf = get_transforms()
    train_ds = CacheDataset(train_files, train_tf, cache_rate=1.0, num_workers=8)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=4, pin_memory=True)
    val_loader = DataLoader(Dataset(partition_dataset(val_files, world, even_divisible=False)[rank], val_tf),
                            batch_size=1, num_workers=2)

    net = ResUNet(deep_supervision=args.deep_supervision).to(device)
    model = DDP(net, device_ids=[local_rank])
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=3e-5)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    dice_metric = DiceMetric(include_background=False, reduction="mean_batch")
    post_pred, post_gt = AsDiscrete(argmax=True, to_onehot=3), AsDiscrete(to_onehot=3)

    out_dir = os.path.join(args.out, f"fold{args.fold}")
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for batch in train_loader:
            x, y = batch["image"].to(device), batch["label"].to(device)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(x)
                if isinstance(out, list):
                    loss = loss_fn(out[0], y) + 0.5 * loss_fn(out[1], y) + 0.25 * loss_fn(out[2], y)
                else:
                    loss = loss_fn(out, y)
            loss.backward()
            opt.step()
            acc += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch + 1}: loss {(acc[0] / acc[1]).item():.4f} ({time.time() - t0:.0f}s)", flush=True)

        if (epoch + 1) % args.val_every == 0:
            net.eval()
            with torch.no_grad():
                for batch in val_loader:
                    x, y = batch["image"].to(device), batch["label"].to(device)
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        logits = sliding_window_inference(x, PATCH, 2, net, overlap=0.5)
                    dice_metric(y_pred=[post_pred(o.float()) for o in decollate_batch(logits)],
                                y=[post_gt(t) for t in decollate_batch(y)])
            gtvp, gtvn = dice_metric.aggregate().tolist()
            dice_metric.reset()
            if rank == 0:
                print(f"  val GTVp {gtvp:.4f} GTVn {gtvn:.4f}", flush=True)
                torch.save({"epoch": epoch + 1, "model": net.state_dict(), "opt": opt.state_dict()},
                           os.path.join(out_dir, "last.pt"))
                if (gtvp + gtvn) / 2 > best:
                    best = (gtvp + gtvn) / 2
                    torch.save(net.state_dict(), os.path.join(out_dir, "best.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
