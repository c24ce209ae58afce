"""Pancreas / pancreatic tumour segmentation (MSD Task07) with our in-house 3D UNet.

Launch (single node, 8 GPUs):
    torchrun --standalone --nproc_per_node=8 06_pancreas_unet3d_bn.py --exp pancreas_bn_v2
"""
import argparse
import json
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from monai.data import CacheDataset, Dataset, list_data_collate, partition_dataset
from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.metrics import DiceMetric
from monai.transforms import (
    AsDiscrete,
    Compose,
    CropForegroundd,
    EnsureChannelFirstd,
    EnsureTyped,
    LoadImaged,
    Orientationd,
    RandCropByPosNegLabeld,
    RandFlipd,
    RandScaleIntensityd,
    ScaleIntensityRanged,
    Spacingd,
)


class ConvBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv3d(cin, cout, 3, padding=1, bias=False),
            nn.BatchNorm3d(cout),
            nn.LeakyReLU(0.01, inplace=True),
            nn.Conv3d(cout, cout, 3, padding=1, bias=False),
            nn.BatchNorm3d(cout),
            nn.LeakyReLU(0.01, inplace=True),
        )

    def forward(self, x):
        return self.block(x)


class UNet3D(nn.Module):
    def __init__(self, in_ch=1, n_classes=3, base=32, depth=5):
        super().__init__()
        chs = [min(base * 2 ** i, 320) for i in range(depth)]
        self.enc = nn.ModuleList()
        prev = in_ch
        for c in chs:
            self.enc.append(ConvBlock(prev, c))
            prev = c
        self.pool = nn.MaxPool3d(2)
        self.up = nn.ModuleList()
        self.dec = nn.ModuleList()
        for i in range(depth - 1, 0, -1):
            self.up.append(nn.ConvTranspose3d(chs[i], chs[i - 1], 2, stride=2))
            self.dec.append(ConvBlock(chs[i - 1] * 2, chs[i - 1]))
        self.head = nn.Conv3d(chs[0], n_classes, 1)

    def forward(self, x):
        skips = []
        for i, blk in enumerate(self.enc):
            x = blk(x)
            if i < len(self.enc) - 1:
                skips.append(x)
                x = self.pool(x)
        for up, dec in zip(self.up, self.dec):
            x = up(x)
            x = dec(torch.cat([x, skips.pop()], dim=1))
        return self.head(x)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--exp", default="pancreas_bn")
    ap.add_argument("--datalist", default="/data/MSD/Task07_Pancreas/dataset.json")
    ap.add_argument("--root", default="/data/MSD/Task07_Pancreas")
    ap.add_argument("--save_root", default="/shared/seg_runs")
    ap.add_argument("--epochs", type=int, default=800)
    ap.add_argument("--patches_per_volume", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval_every", type=int, default=25)
    ap.add_argument("--seed", type=int, default=7)
    return ap.parse_args()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    with open(args.datalist) as f:
        meta = json.load(f)
    items = [{"image": os.path.join(args.root, d["image"]), "label": os.path.join(args.root, d["label"])}
             for d in meta["training"]]
    items.sort(key=lambda d: d["image"])
    val_items, train_items = items[:56], items[56:]

    pre = [
        LoadImaged(keys=["image", "label"]),
        EnsureChannelFirstd(keys=["image", "label"]),
        Orientationd(keys=["image", "label"], axcodes="RAS"),
        Spacingd(keys=["image", "label"], pixdim=(0.8, 0.8, 2.5), mode=("bilinear", "nearest")),
        ScaleIntensityRanged(keys="image", a_min=-96, a_max=215, b_min=0, b_max=1, clip=True),
        CropForegroundd(keys=["image", "label"], source_key="image"),
        EnsureTyped(keys=["image", "label"]),
    ]
    train_tf = Compose(pre + [
        RandCropByPosNegLabeld(keys=["image", "label"], label_key="label", spatial_size=(160, 160, 64),
                               pos=2, neg=1, num_samples=args.patches_per_volume),
        RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=0),
        RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=1),
        RandScaleIntensityd(keys="image", factors=0.1, prob=0.5),
    ])
    val_tf = Compose(pre)

    train_ds = CacheDataset(train_items, train_tf, cache_rate=1.0, num_workers=8)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    # one volume per GPU -> patches_per_volume patches per step on each GPU
    train_dl = DataLoader(train_ds, batch_size=1, sampler=train_sampler, num_workers=4,
                          collate_fn=list_data_collate, pin_memory=True)
    val_dl = DataLoader(Dataset(partition_dataset(val_items, world, even_divisible=False)[rank], val_tf),
                        batch_size=1, num_workers=2)

    net = UNet3D(in_ch=1, n_classes=3).to(dev)
    model = DDP(net, device_ids=[local_rank])

    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.99, nesterov=True, weight_decay=3e-5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: (1 - e / args.epochs) ** 0.9)
    dice = DiceMetric(include_background=False, reduction="mean_batch")
    to_pred = AsDiscrete(argmax=True, to_onehot=3)
    to_gt = AsDiscrete(to_onehot=3)

    save_dir = os.path.join(args.save_root, args.exp)
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        history = []
    best = 0.0

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        loss_acc = torch.zeros(2, device=dev)
        for batch in train_dl:
            x = batch["image"].to(dev, non_blocking=True)
            y = batch["label"].to(dev, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 12.0)
            opt.step()
            loss_acc += torch.tensor([loss.item(), 1.0], device=dev)
        sched.step()
        dist.all_reduce(loss_acc)
        train_loss = (loss_acc[0] / loss_acc[1]).item()

        if (epoch + 1) % args.eval_every == 0:
            model.eval()
            with torch.no_grad():
                for batch in val_dl:
                    x = batch["image"].to(dev)
                    y = batch["label"].to(dev)
                    out = sliding_window_inference(x, (160, 160, 64), 4, net, overlap=0.5)
                    dice(y_pred=[to_pred(o) for o in out], y=[to_gt(t) for t in y])
            pancreas, tumour = dice.aggregate().tolist()
            dice.reset()
            if rank == 0:
                history.append({"epoch": epoch + 1, "loss": train_loss, "pancreas": pancreas, "tumour": tumour})
                print(f"ep {epoch + 1}: loss {train_loss:.4f} pancreas {pancreas:.4f} tumour {tumour:.4f}", flush=True)
                if pancreas + tumour > best:
                    best = pancreas + tumour
                    torch.save({"epoch": epoch + 1, "model": net.state_dict()}, os.path.join(save_dir, "best.pt"))
                torch.save({"epoch": epoch + 1, "model": net.state_dict(), "opt": opt.state_dict(),
                            "sched": sched.state_dict()}, os.path.join(save_dir, "last.pt"))
                with open(os.path.join(save_dir, "history.json"), "w") as f:
                    json.dump(history, f, indent=1)
            dist.barrier()
        elif rank == 0:
            print(f"ep {epoch + 1}: loss {train_loss:.4f}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
