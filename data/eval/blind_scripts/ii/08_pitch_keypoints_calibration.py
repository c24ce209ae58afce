"""Pitch registration for broadcast soccer: predict heatmaps of the 57 field
keypoints (line intersections, penalty-arc tangents, ...) from which the
camera homography is solved downstream.

UNet (ResNet-34 encoder, segmentation_models_pytorch) at 1/2 resolution,
trained with a weighted MSE on Gaussian heatmaps.

    torchrun --nproc_per_node=8 08_pitch_keypoints_calibration.py --cfg cfg/calib_r34.yaml
"""
import argparse
import json
import os
import shutil
import time
from pathlib import Path

import albumentations as A
import cv2
import numpy as np
import segmentation_models_pytorch as smp
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from albumentations.pytorch import ToTensorV2
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

NUM_KP = 57


def load_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    ap.add_argument("--resume", action="store_true")
    a = ap.parse_args()
    cfg = yaml.safe_load(open(a.cfg))
    cfg["resume"] = a.resume
    return cfg


class CalibFrames(Dataset):
    def __init__(self, root, split, size=(540, 960), sigma=3.0, train=True):
        self.root = Path(root) / split
        self.items = sorted(json.load(open(self.root / "keypoints.json")).items())
        self.h, self.w = size
        self.sigma = sigma
        kp_params = A.KeypointParams(format="xy", remove_invisible=False, label_fields=["kp_ids"])
        if train:
            self.tf = A.Compose([A.Resize(self.h, self.w), A.ColorJitter(0.3, 0.3, 0.3, 0.05, p=0.8),
                                 A.GaussNoise(p=0.2), A.MotionBlur(p=0.2),
                                 A.Normalize(), ToTensorV2()], keypoint_params=kp_params)
        else:
            self.tf = A.Compose([A.Resize(self.h, self.w), A.Normalize(), ToTensorV2()], keypoint_params=kp_params)

    def __len__(self):
        return len(self.items)

    def heatmaps(self, kps, ids):
        oh, ow = self.h // 2, self.w // 2
        hm = np.zeros((NUM_KP, oh, ow), np.float32)
        vis = np.zeros(NUM_KP, np.float32)
        ys, xs = np.mgrid[0:oh, 0:ow]
        for (x, y), k in zip(kps, ids):
            x, y = x / 2, y / 2
            if 0 <= x < ow and 0 <= y < oh:
                hm[k] = np.exp(-((xs - x) ** 2 + (ys - y) ** 2) / (2 * self.sigma ** 2))
                vis[k] = 1
        return hm, vis

    def __getitem__(self, i):
        name, ann = self.items[i]
        img = cv2.cvtColor(cv2.imread(str(self.root / "images" / name)), cv2.COLOR_BGR2RGB)
        kps = [(p["x"], p["y"]) for p in ann]
        ids = [p["id"] for p in ann]
        out = self.tf(image=img, keypoints=kps, kp_ids=ids)
        hm, vis = self.heatmaps(out["keypoints"], out["kp_ids"])
        return out["image"], torch.from_numpy(hm), torch.from_numpy(vis)


def heatmap_loss(pred, gt, vis):
    w = 1.0 + 9.0 * gt                      # emphasise the peaks
    per_kp = ((pred - gt) ** 2 * w).mean(dim=(2, 3))
    return (per_kp * (0.1 + vis)).mean()


@torch.no_grad()
def pck(pred, gt, vis, thr_px=5.0):
    B, K, H, W = pred.shape
    p = pred.flatten(2).argmax(-1)
    g = gt.flatten(2).argmax(-1)
    d = torch.sqrt(((p % W - g % W) ** 2 + (p // W - g // W) ** 2).float()) * 2  # back to input pixels
    hit = ((d <= thr_px).float() * vis).sum()
    return hit, vis.sum()


def save_checkpoint(state, out_dir, is_best):
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.save(state, out_dir / "checkpoint.pth")
    if is_best:
        shutil.copyfile(out_dir / "checkpoint.pth", out_dir / "model_best.pth")


def main():
    cfg = load_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    out_dir = Path(cfg["out_dir"])

    train_ds = CalibFrames(cfg["data_root"], "train", train=True)
    val_ds = CalibFrames(cfg["data_root"], "valid", train=False)
    train_sampler = DistributedSampler(train_ds)
    train_loader = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=train_sampler,
                              num_workers=cfg.get("workers", 8), pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)),
                            batch_size=cfg["batch_size"], num_workers=cfg.get("workers", 8), pin_memory=True)

    model = smp.Unet("resnet34", encoder_weights="imagenet", classes=NUM_KP, decoder_channels=(256, 128, 64, 32, 16))
    # decoder stops at 1/2 resolution
    model.segmentation_head = nn.Sequential(nn.Conv2d(32, NUM_KP, 3, padding=1))
    model.decoder.blocks = model.decoder.blocks[:4]
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    base_lr = cfg["lr"] * cfg["batch_size"] * world / cfg.get("ref_batch", 64)
    optimizer = torch.optim.Adam(model.parameters(), lr=base_lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0=cfg["epochs"] // 3)

    start_epoch, best_pck = 0, 0.0
    if cfg["resume"] and (out_dir / "checkpoint.pth").exists():
        ckpt = torch.load(out_dir / "checkpoint.pth", map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_pck = ckpt["epoch"] + 1, ckpt["best_pck"]
        if rank == 0:
            print(f"resumed from epoch {ckpt['epoch']}")

    for epoch in range(start_epoch, cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros((), device=device)
        for i, (img, hm, vis) in enumerate(train_loader):
            img, hm, vis = img.to(device, non_blocking=True), hm.to(device, non_blocking=True), vis.to(device)
            pred = model(img)
            loss = heatmap_loss(pred, hm, vis)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step(epoch + i / len(train_loader))
            loss_sum += loss.detach()
        dist.all_reduce(loss_sum)
        train_loss = loss_sum.item() / (world * len(train_loader))

        model.eval()
        hits = torch.zeros(2, device=device)
        with torch.no_grad():
            for img, hm, vis in val_loader:
                img, hm, vis = img.to(device), hm.to(device), vis.to(device)
                h, n = pck(model.module(img), hm, vis)
                hits += torch.stack([h, n])
        dist.all_reduce(hits)
        val_pck = (hits[0] / hits[1].clamp(min=1)).item()

        is_best = val_pck > best_pck
        best_pck = max(best_pck, val_pck)
        save_checkpoint({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                         "scheduler": scheduler.state_dict(), "epoch": epoch, "best_pck": best_pck},
                        out_dir, is_best)
        if rank == 0:
            print(f"epoch {epoch} train_loss {train_loss:.5f} val PCK@5px {val_pck:.4f} "
                  f"(best {best_pck:.4f}) {time.time() - t0:.0f}s", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
