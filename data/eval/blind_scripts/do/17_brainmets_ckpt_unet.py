"""Brain metastasis segmentation on T1c + FLAIR (in-house cohort), 5-fold CV.

Large patches (160^3) with activation checkpointing in the encoder so that
batch 2 fits on the 40 GB A100s.

    torchrun --standalone --nproc_per_node=8 17_brainmets_ckpt_unet.py --fold 2
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.model_selection import KFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data.distributed import DistributedSampler

from monai.data import CacheDataset, DataLoader, Dataset
from monai.inferers import sliding_window_inference
from monai.losses import DiceFocalLoss
from monai.networks.blocks import Convolution
from monai.transforms import (
    Compose,
    ConcatItemsd,
    EnsureChannelFirstd,
    EnsureTyped,
    LoadImaged,
    NormalizeIntensityd,
    Orientationd,
    RandAffined,
    RandCropByPosNegLabeld,
    RandFlipd,
    Spacingd,
)

PATCH = (160, 160, 160)


def conv_block(cin, cout, stride=1):
    return nn.Sequential(
        Convolution(3, cin, cout, strides=stride, kernel_size=3, norm=("instance", {"affine": True}), act="LEAKYRELU"),
        Convolution(3, cout, cout, kernel_size=3, norm=("instance", {"affine": True}), act="LEAKYRELU"),
    )


class CheckpointedUNet(nn.Module):
    def __init__(self, in_ch=2, out_ch=2, feats=(24, 48, 96, 192, 320), use_ckpt=True):
        super().__init__()
        self.use_ckpt = use_ckpt
        self.enc = nn.ModuleList([conv_block(in_ch, feats[0])] +
                                 [conv_block(feats[i], feats[i + 1], 2) for i in range(len(feats) - 1)])
        self.upconv = nn.ModuleList(nn.ConvTranspose3d(feats[i + 1], feats[i], 2, 2)
                                    for i in reversed(range(len(feats) - 1)))
        self.dec = nn.ModuleList(conv_block(2 * feats[i], feats[i]) for i in reversed(range(len(feats) - 1)))
        self.out = nn.Conv3d(feats[0], out_ch, 1)

    def forward(self, x):
        skips = []
        for blk in self.enc:
            if self.use_ckpt and self.training:
                x = checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
            skips.append(x)
        x = skips.pop()
        for up, blk in zip(self.upconv, self.dec):
            x = blk(torch.cat([up(x), skips.pop()], dim=1))
        return self.out(x)


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cohort_csv", default="/research/mets/cohort_v3.csv")
    ap.add_argument("--fold", type=int, default=0)
    ap.add_argument("--out", default="/research/mets/runs/ckpt_unet")
    ap.add_argument("--epochs", type=int, default=350)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--val_every", type=int, default=10)
    return ap.parse_args()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    df = pd.read_csv(args.cohort_csv).sort_values("patient_id").reset_index(drop=True)
    # split by patient; fixed random_state so every rank gets the same folds
    folds = list(KFold(n_splits=5, shuffle=True, random_state=42).split(df))
    tr_idx, va_idx = folds[args.fold]
    as_items = lambda d: [{"id": r.patient_id, "t1c": r.t1c, "flair": r.flair, "label": r.mask}
                          for r in d.itertuples()]
    train_items, val_items = as_items(df.iloc[tr_idx]), as_items(df.iloc[va_idx])

    pre = [
        LoadImaged(keys=["t1c", "flair", "label"]),
        EnsureChannelFirstd(keys=["t1c", "flair", "label"]),
        Orientationd(keys=["t1c", "flair", "label"], axcodes="RAS"),
        Spacingd(keys=["t1c", "flair", "label"], pixdim=1.0, mode=("bilinear", "bilinear", "nearest")),
        ConcatItemsd(keys=["t1c", "flair"], name="image"),
        NormalizeIntensityd(keys="image", nonzero=True, channel_wise=True),
        EnsureTyped(keys=["image", "label"]),
    ]
    train_tf = Compose(pre + [
        RandCropByPosNegLabeld(keys=["image", "label"], label_key="label", spatial_size=PATCH, pos=2, neg=1,
                               num_samples=1),
        RandAffined(keys=["image", "label"], prob=0.3, rotate_range=(0.26,) * 3, scale_range=(0.1,) * 3,
                    mode=("bilinear", "nearest")),
        RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=0),
    ])
    val_tf = Compose(pre)

    train_ds = CacheDataset(train_items, train_tf, cache_rate=1.0, num_workers=8)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=6, pin_memory=True)
    val_ds = Dataset(val_items, val_tf)
    # padded sampler: duplicates are removed below by patient id
    val_loader = DataLoader(val_ds, batch_size=1, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=2)

    net = CheckpointedUNet().to(device)
    model = DDP(net, device_ids=[local_rank])
    loss_fn = DiceFocalLoss(to_onehot_y=True, softmax=True, include_background=False, gamma=2.0)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    scaler = torch.cuda.amp.GradScaler()

    out_dir = os.path.join(args.out, f"fold{args.fold}")
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for batch in train_loader:
            x, y = batch["image"].to(device, non_blocking=True), batch["label"].to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            acc += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch + 1}: loss {(acc[0] / acc[1]).item():.4f} ({time.time() - t0:.0f}s)", flush=True)

        if (epoch + 1) % args.val_every:
            continue
        model.eval()
        local = {}
        with torch.no_grad():
            for batch in val_loader:
                x = batch["image"].to(device)
                with torch.autocast("cuda", dtype=torch.float16):
                    pred = sliding_window_inference(x, PATCH, 2, net, overlap=0.5).argmax(1)
                gt = batch["label"][:, 0].to(device) > 0
                p = pred > 0
                denom = (p.sum() + gt.sum()).item()
                local[batch["id"][0]] = 1.0 if denom == 0 else 2.0 * (p & gt).sum().item() / denom
        gathered = [None] * world
        dist.all_gather_object(gathered, local)
        per_patient = {}
        for part in gathered:
            per_patient.update(part)
        mean_dice = float(np.mean(list(per_patient.values())))
        if rank == 0:
            print(f"  val dice {mean_dice:.4f} over {len(per_patient)} patients", flush=True)
            torch.save({"epoch": epoch + 1, "model": net.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "scaler": scaler.state_dict()},
                       os.path.join(out_dir, "last.pt"))
            if mean_dice > best:
                best = mean_dice
                torch.save(net.state_dict(), os.path.join(out_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
