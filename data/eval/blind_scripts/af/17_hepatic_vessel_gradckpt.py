"""
Hepatic vessel + tumour segmentation (MSD Task08) with a wide residual 3D UNet.
Encoder stages use activation checkpointing so that 160^3 patches fit in 40 GB.

    torchrun --nproc_per_node=4 17_hepatic_vessel_gradckpt.py --data /data/Task08_HepaticVessel --out exp/hv_wide
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from monai.data import CacheDataset, DataLoader, DistributedSampler, decollate_batch
from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.metrics import DiceMetric
from monai.transforms import (AsDiscrete, Compose, CropForegroundd, EnsureChannelFirstd, EnsureTyped, LoadImaged,
                              Orientationd, RandCropByLabelClassesd, RandFlipd, RandGaussianSmoothd,
                              RandScaleIntensityd, ScaleIntensityRanged, Spacingd, SpatialPadd)


class ResBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv3d(cin, cout, 3, stride, 1, bias=False)
        self.n1 = nn.InstanceNorm3d(cout, affine=True)
        self.conv2 = nn.Conv3d(cout, cout, 3, 1, 1, bias=False)
        self.n2 = nn.InstanceNorm3d(cout, affine=True)
        self.skip = nn.Identity() if (cin == cout and stride == 1) else nn.Sequential(
            nn.Conv3d(cin, cout, 1, stride, bias=False), nn.InstanceNorm3d(cout, affine=True))

    def forward(self, x):
        h = F.leaky_relu(self.n1(self.conv1(x)), 0.01)
        h = self.n2(self.conv2(h))
        return F.leaky_relu(h + self.skip(x), 0.01)


class WideResUNet(nn.Module):
    def __init__(self, in_ch=1, n_cls=3, widths=(48, 96, 192, 384, 480), grad_ckpt=True):
        super().__init__()
        self.grad_ckpt = grad_ckpt
        self.stem = nn.Sequential(nn.Conv3d(in_ch, widths[0], 3, 1, 1, bias=False),
                                  nn.InstanceNorm3d(widths[0], affine=True), nn.LeakyReLU(0.01, inplace=True))
        self.stages = nn.ModuleList()
        c = widths[0]
        for i, w in enumerate(widths):
            self.stages.append(nn.Sequential(ResBlock(c, w, 1 if i == 0 else 2), ResBlock(w, w)))
            c = w
        self.up = nn.ModuleList()
        self.dec = nn.ModuleList()
        for i in range(len(widths) - 1, 0, -1):
            self.up.append(nn.ConvTranspose3d(widths[i], widths[i - 1], 2, 2))
            self.dec.append(ResBlock(2 * widths[i - 1], widths[i - 1]))
        self.head = nn.Conv3d(widths[0], n_cls, 1)

    def forward(self, x):
        x = self.stem(x)
        feats = []
        for stage in self.stages:
            if self.grad_ckpt and self.training:
                x = checkpoint(stage, x)
            else:
                x = stage(x)
            feats.append(x)
        x = feats.pop()
        for up, dec in zip(self.up, self.dec):
            x = dec(torch.cat([up(x), feats.pop()], 1))
        return self.head(x)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/Task08_HepaticVessel")
    ap.add_argument("--out", default="exp/hv_wide")
    ap.add_argument("--epochs", type=int, default=500)
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--patch", type=int, default=160)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--val_every", type=int, default=10)
    ap.add_argument("--no_grad_ckpt", action="store_true")
    return ap.parse_args()


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    patch = (args.patch,) * 3

    with open(os.path.join(args.data, "dataset.json")) as f:
        tr = json.load(f)["training"]
    items = [{"image": os.path.join(args.data, d["image"]), "label": os.path.join(args.data, d["label"])} for d in tr]
    val_items, train_items = items[:40], items[40:]

    keys = ["image", "label"]
    pre = [LoadImaged(keys=keys), EnsureChannelFirstd(keys=keys), Orientationd(keys=keys, axcodes="RAS"),
           Spacingd(keys=keys, pixdim=(0.8, 0.8, 1.5), mode=("bilinear", "nearest")),
           ScaleIntensityRanged(keys="image", a_min=-10, a_max=240, b_min=0, b_max=1, clip=True),
           CropForegroundd(keys=keys, source_key="image"), EnsureTyped(keys=keys, track_meta=False)]
    train_tf = Compose(pre + [
        SpatialPadd(keys=keys, spatial_size=patch),
        RandCropByLabelClassesd(keys=keys, label_key="label", spatial_size=patch, ratios=[1, 2, 2], num_classes=3,
                                num_samples=2),
        RandFlipd(keys=keys, prob=0.5, spatial_axis=0),
        RandFlipd(keys=keys, prob=0.5, spatial_axis=1),
        RandGaussianSmoothd(keys="image", prob=0.1),
        RandScaleIntensityd(keys="image", factors=0.15, prob=0.3),
    ])
    train_ds = CacheDataset(train_items, train_tf, cache_rate=1.0, num_workers=8)
    val_ds = CacheDataset(val_items, Compose(pre), cache_rate=1.0, num_workers=8)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=8, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=1, sampler=DistributedSampler(val_ds, shuffle=False,
                                                                            even_divisible=False), num_workers=2)

    net = WideResUNet(grad_ckpt=not args.no_grad_ckpt).to(dev)
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True, batch=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs, eta_min=1e-6)
    scaler = torch.cuda.amp.GradScaler()
    metric = DiceMetric(include_background=False, reduction="mean_batch")
    to_pred, to_lbl = AsDiscrete(argmax=True, to_onehot=3), AsDiscrete(to_onehot=3)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, losses = time.time(), []
        for batch in train_loader:
            x, y = batch["image"].to(dev, non_blocking=True), batch["label"].to(dev, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            with torch.cuda.amp.autocast():
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
        sched.step()
        if rank == 0:
            print(f"epoch {epoch} loss {np.mean(losses):.4f} {time.time() - t0:.0f}s", flush=True)

        if (epoch + 1) % args.val_every == 0:
            net.eval()
            with torch.no_grad(), torch.cuda.amp.autocast():
                for batch in val_loader:
                    x, y = batch["image"].to(dev), batch["label"].to(dev)
                    out = sliding_window_inference(x, patch, 2, net, overlap=0.5)
                    metric(y_pred=[to_pred(o) for o in decollate_batch(out)],
                           y=[to_lbl(t) for t in decollate_batch(y)])
            vessel, tumour = metric.aggregate().tolist()
            metric.reset()
            score = (vessel + tumour) / 2
            if rank == 0:
                print(f"  dice vessel {vessel:.4f} tumour {tumour:.4f}", flush=True)
                torch.save({"epoch": epoch, "model": net.state_dict(), "opt": opt.state_dict()},
                           os.path.join(args.out, "last.pt"))
                if score > best:
                    torch.save(net.state_dict(), os.path.join(args.out, "best.pt"))
            best = max(best, score)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
