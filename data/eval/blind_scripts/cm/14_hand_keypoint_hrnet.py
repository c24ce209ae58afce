#!/usr/bin/env python3
"""
21-keypoint 2D hand pose (OneHand10K / RHD style COCO-format annotations),
HRNet-W18 heatmap head, flip augmentation, PCK@0.2 / EPE / AUC on the test split.

Launch:
    torchrun --nproc_per_node=8 14_hand_keypoint_hrnet.py --cfg configs/hand_hrnet_w18.yaml
"""
import argparse
import json
import os
import time

import cv2
import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    parser = argparse.ArgumentParser(description="hand keypoints")
    parser.add_argument("--cfg", required=True, type=str)
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--resume", default="", type=str)
    return parser.parse_args()


class HandKeypoints(Dataset):
    NUM_JOINTS = 21

    def __init__(self, ann_file, img_root, input_size, heatmap_size, sigma, is_train):
        with open(ann_file) as f:
            coco = json.load(f)
        images = {im["id"]: im for im in coco["images"]}
        self.samples = [(images[a["image_id"]]["file_name"], np.array(a["bbox"], np.float32),
                         np.array(a["keypoints"], np.float32).reshape(-1, 3)) for a in coco["annotations"]]
        self.img_root, self.input_size, self.heatmap_size = img_root, input_size, heatmap_size
        self.sigma, self.is_train = sigma, is_train

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        fname, bbox, kpts = self.samples[idx]
        img = cv2.imread(os.path.join(self.img_root, fname))
        img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
        x, y, w, h = bbox
        center = np.array([x + w / 2, y + h / 2], np.float32)
        size = max(w, h) * 1.5
        rot = 0.0
        if self.is_train:
            size *= np.random.uniform(0.8, 1.2)
            rot = np.random.uniform(-90, 90)
            center += np.random.uniform(-0.05, 0.05, 2).astype(np.float32) * size
        S = self.input_size
        M = cv2.getRotationMatrix2D(tuple(center.tolist()), rot, S / size)
        M[:, 2] += np.array([S / 2, S / 2]) - center
        patch = cv2.warpAffine(img, M, (S, S), flags=cv2.INTER_LINEAR)
        pts = np.c_[kpts[:, :2], np.ones(self.NUM_JOINTS)] @ M.T
        vis = (kpts[:, 2] > 0).astype(np.float32)
        if self.is_train and np.random.rand() < 0.5:
            # the hand crops are not left/right labelled here, so a mirror keeps joint ids
            patch = patch[:, ::-1].copy()
            pts[:, 0] = S - 1 - pts[:, 0]

        H = self.heatmap_size
        stride = S / H
        tmp = int(3 * self.sigma)
        heat = np.zeros((self.NUM_JOINTS, H, H), np.float32)
        for j in range(self.NUM_JOINTS):
            cx, cy = pts[j] / stride
            ix, iy = int(cx + 0.5), int(cy + 0.5)
            if vis[j] == 0 or ix - tmp >= H or iy - tmp >= H or ix + tmp < 0 or iy + tmp < 0:
                vis[j] = 0
                continue
            xs = np.arange(max(0, ix - tmp), min(H, ix + tmp + 1))
            ys = np.arange(max(0, iy - tmp), min(H, iy + tmp + 1))
            heat[j, ys[0]:ys[-1] + 1, xs[0]:xs[-1] + 1] = np.exp(
                -((xs[None] - cx) ** 2 + (ys[:, None] - cy) ** 2) / (2 * self.sigma ** 2))
        inp = torch.from_numpy(patch.transpose(2, 0, 1).astype(np.float32) / 255.0)
        inp = (inp - 0.45) / 0.225
        return inp, torch.from_numpy(heat), torch.from_numpy(vis), torch.from_numpy(pts.astype(np.float32)), \
            torch.tensor(max(w, h) * S / size, dtype=torch.float32)


class HandNet(nn.Module):
    def __init__(self, num_joints=21):
        super().__init__()
        self.backbone = timm.create_model("hrnet_w18", pretrained=True, features_only=True,
                                          feature_location="", out_indices=(1, 2, 3, 4))
        c = sum(self.backbone.feature_info.channels())
        self.head = nn.Sequential(nn.Conv2d(c, c, 1), nn.BatchNorm2d(c), nn.ReLU(inplace=True),
                                  nn.Conv2d(c, num_joints, 1))

    def forward(self, x):
        f = self.backbone(x)
        f = [f[0]] + [F.interpolate(t, size=f[0].shape[-2:], mode="bilinear", align_corners=False) for t in f[1:]]
        return self.head(torch.cat(f, 1))


@torch.no_grad()
def evaluate(model, loader, n_total, world_size, stride):
    model.eval()
    epe_all, vis_all, norm_all = [], [], []
    for inp, _, vis, pts, norm in loader:
        hm = model(inp.cuda(non_blocking=True))
        b, k, h, w = hm.shape
        am = hm.flatten(2).argmax(-1)
        pred = torch.stack([am % w, am // w], -1).float() * stride
        epe_all.append(torch.linalg.norm(pred - pts.cuda(), dim=-1))
        vis_all.append(vis.cuda())
        norm_all.append(norm.cuda())
    local = torch.cat([torch.cat(epe_all), torch.cat(vis_all), torch.cat(norm_all)[:, None]], 1)
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local)
    full = torch.stack(gathered, 1).flatten(0, 1)[:n_total]  # undo the sampler's round-robin + padding
    epe, vis, norm = full[:, :21], full[:, 21:42], full[:, 42:]
    pck = ((epe < 0.2 * norm).float() * vis).sum() / vis.sum()
    mean_epe = (epe * vis).sum() / vis.sum()
    thresholds = torch.linspace(0, 30, 31, device=epe.device)
    auc = torch.stack([((epe < t).float() * vis).sum() / vis.sum() for t in thresholds]).mean()
    return pck.item(), mean_epe.item(), auc.item()


def main():
    args = parse_args()
    with open(args.cfg) as f:
        cfg = yaml.safe_load(f)

    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    d = cfg["data"]
    train_set = HandKeypoints(d["train_ann"], d["img_root"], d["input_size"], d["heatmap_size"], d["sigma"], True)
    test_set = HandKeypoints(d["test_ann"], d["img_root"], d["input_size"], d["heatmap_size"], d["sigma"], False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    train_loader = DataLoader(train_set, cfg["train"]["batch_size"], sampler=train_sampler,
                              num_workers=cfg["workers"], pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, cfg["test"]["batch_size"], sampler=test_sampler,
                             num_workers=cfg["workers"], pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(HandNet()).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["train"]["lr"], weight_decay=cfg["train"]["wd"])
    epochs = cfg["train"]["epochs"]
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, epochs * len(train_loader))
    start_epoch, best_auc = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_auc = ckpt["epoch"], ckpt["best_auc"]

    out_dir = cfg["output_dir"]
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
    stride = d["input_size"] / d["heatmap_size"]
    for epoch in range(start_epoch, epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (inp, heat, vis, _, _) in enumerate(train_loader):
            inp, heat, vis = inp.to(device, non_blocking=True), heat.to(device, non_blocking=True), vis.to(device)
            out = model(inp)
            loss = (F.mse_loss(out, heat, reduction="none").mean((2, 3)) * vis).sum() / vis.sum().clamp(min=1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if rank == 0 and it % 50 == 0:
                print(f"epoch {epoch} [{it}/{len(train_loader)}] loss {loss.item():.6f}", flush=True)

        pck, epe, auc = evaluate(model, test_loader, len(test_set), world_size, stride)
        if rank == 0:
            print(f"epoch {epoch}: PCK@0.2 {pck:.4f} EPE {epe:.2f}px AUC {auc:.4f} ({time.time() - t0:.0f}s)")
            best_auc = max(best_auc, auc)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch + 1, "best_auc": best_auc},
                       os.path.join(out_dir, "latest.pth"))
            if auc >= best_auc:
                torch.save(model.module.state_dict(), os.path.join(out_dir, "best.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
