"""Rooftop / utility-scale PV panel segmentation on 0.1-0.3 m aerial imagery (PV01/PV03 + in-house).

UNet++ with a ConvNeXt-Tiny encoder (timm via smp), Lovasz + BCE loss. Patches are
pre-cut 512x512 PNGs listed in CSV manifests.

    torchrun --nproc_per_node=8 20_solar_panel_seg.py --train-csv splits/train.csv --val-csv splits/val.csv
"""
import argparse
import logging
import os
import shutil
import time

import numpy as np
import pandas as pd
import segmentation_models_pytorch as smp
import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("pv")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-csv", required=True)
    ap.add_argument("--val-csv", required=True)
    ap.add_argument("--ckpt-dir", default="/shared/pv_seg/ckpt/unetpp_convnext_t")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


class PVPatches(Dataset):
    def __init__(self, csv, train):
        df = pd.read_csv(csv)
        self.imgs, self.masks = df["image"].tolist(), df["mask"].tolist()
        self.train = train

    def __len__(self):
        return len(self.imgs)

    def __getitem__(self, i):
        img = np.asarray(Image.open(self.imgs[i]).convert("RGB"), np.float32) / 255.0
        msk = (np.asarray(Image.open(self.masks[i])) > 0).astype(np.float32)
        if self.train:
            k = np.random.randint(4)
            img, msk = np.rot90(img, k), np.rot90(msk, k)
            if np.random.rand() < 0.5:
                img, msk = img[::-1], msk[::-1]
            img = np.clip(img * np.random.uniform(0.8, 1.2) + np.random.uniform(-0.08, 0.08), 0, 1)
        img = (img - np.array([0.485, 0.456, 0.406], np.float32)) / np.array([0.229, 0.224, 0.225], np.float32)
        return torch.from_numpy(img.transpose(2, 0, 1).copy()), torch.from_numpy(msk[None].copy())


def lovasz_hinge_flat(logits, labels):
    signs = 2.0 * labels - 1.0
    errors = 1.0 - logits * signs
    errors_sorted, perm = torch.sort(errors, descending=True)
    gt_sorted = labels[perm]
    gts = gt_sorted.sum()
    inter = gts - gt_sorted.cumsum(0)
    union = gts + (1 - gt_sorted).cumsum(0)
    jac = 1.0 - inter / union
    jac[1:] = jac[1:] - jac[:-1]
    return torch.dot(torch.relu(errors_sorted), jac)


def criterion(logits, target):
    bce = nn.functional.binary_cross_entropy_with_logits(logits, target)
    lov = torch.stack([lovasz_hinge_flat(l.flatten(), t.flatten()) for l, t in zip(logits, target)]).mean()
    return bce + lov


def save_checkpoint(state, is_best, ckpt_dir):
    path = os.path.join(ckpt_dir, "last.pth")
    torch.save(state, path)
    if is_best:
        shutil.copyfile(path, os.path.join(ckpt_dir, "best.pth"))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0
    logging.basicConfig(level=logging.INFO if is_main else logging.WARNING, format="%(asctime)s %(message)s")

    train_ds = PVPatches(args.train_csv, train=True)
    val_ds = PVPatches(args.val_csv, train=False)
    val_ds.imgs, val_ds.masks = val_ds.imgs[rank::world], val_ds.masks[rank::world]
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=32, num_workers=4, pin_memory=True)

    model = smp.UnetPlusPlus("tu-convnext_tiny", encoder_weights="imagenet", classes=1,
                             decoder_attention_type="scse")
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs, steps_per_epoch=len(train_dl),
                                                pct_start=0.05)
    start_epoch, best_iou = 0, 0.0
    os.makedirs(args.ckpt_dir, exist_ok=True)
    last = os.path.join(args.ckpt_dir, "last.pth")
    if args.resume and os.path.isfile(last):
        ckpt = torch.load(last, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        start_epoch, best_iou = ckpt["epoch"] + 1, ckpt["best_iou"]
        log.info("resumed from epoch %d", ckpt["epoch"])
    model = DDP(model, device_ids=[local_rank])
    scaler = torch.cuda.amp.GradScaler()

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for img, msk in train_dl:
            img, msk = img.to(device, non_blocking=True), msk.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(img)
            loss = criterion(logits.float(), msk)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(run)

        model.eval()
        s = torch.zeros(3, device=device, dtype=torch.float64)
        with torch.no_grad():
            for img, msk in val_dl:
                with torch.autocast("cuda", dtype=torch.float16):
                    pred = model.module(img.to(device)) > 0
                gt = msk.to(device) > 0.5
                s += torch.stack([(pred & gt).sum(), (pred & ~gt).sum(), (~pred & gt).sum()]).double()
        dist.all_reduce(s)
        tp, fp, fn = s.tolist()
        iou = tp / max(tp + fp + fn, 1)
        is_best = iou > best_iou
        best_iou = max(iou, best_iou)
        log.info("epoch %d loss %.4f val IoU %.4f best %.4f (%.0fs)", epoch, (run[0] / run[1]).item(), iou, best_iou,
                 time.time() - t0)

        save_checkpoint({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                         "scheduler": sched.state_dict(), "epoch": epoch, "best_iou": best_iou},
                        is_best, args.ckpt_dir)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
