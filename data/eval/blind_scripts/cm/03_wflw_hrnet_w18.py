"""
98-point facial landmark detection on WFLW, heatmap regression with an
HRNet-W18 backbone (timm), trained with DDP.

Usage:
    torchrun --nproc_per_node=4 03_wflw_hrnet_w18.py --config configs/wflw_hrnet_w18.yaml
"""
import argparse
import math
import os
import random
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
from torch.utils.tensorboard import SummaryWriter

DEFAULTS = dict(
    data_root="/data/WFLW",
    train_list="list_98pt_rect_attr_train.txt",
    test_list="list_98pt_rect_attr_test.txt",
    image_size=256,
    heatmap_size=64,
    sigma=1.5,
    batch_size=16,
    lr=2e-4,
    epochs=60,
    lr_steps=[30, 50],
    workers=8,
    out_dir="runs/wflw_hrnet_w18",
)


class WFLW(Dataset):
    def __init__(self, root, list_file, image_size, heatmap_size, sigma, train):
        self.root = root
        self.image_size, self.heatmap_size, self.sigma = image_size, heatmap_size, sigma
        self.train = train
        self.samples = []
        with open(os.path.join(root, "WFLW_annotations", "list_98pt_rect_attr_train_test", list_file)) as f:
            for line in f:
                parts = line.strip().split()
                pts = np.array(parts[:196], np.float32).reshape(98, 2)
                box = np.array(parts[196:200], np.float32)
                self.samples.append((parts[-1], pts, box))

    def __len__(self):
        return len(self.samples)

    def _gaussian(self, pts):
        hs = self.heatmap_size
        xs = np.arange(hs, dtype=np.float32)
        ys = xs[:, None]
        hm = np.zeros((len(pts), hs, hs), np.float32)
        for i, (x, y) in enumerate(pts):
            if 0 <= x < hs and 0 <= y < hs:
                hm[i] = np.exp(-((xs - x) ** 2 + (ys - y) ** 2) / (2 * self.sigma ** 2))
        return hm

    def __getitem__(self, idx):
        name, pts, box = self.samples[idx]
        img = cv2.imread(os.path.join(self.root, "WFLW_images", name))
        img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
        cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
        size = max(box[2] - box[0], box[3] - box[1]) * 1.25
        angle, scale = 0.0, 1.0
        if self.train:
            angle = random.uniform(-30, 30)
            scale = random.uniform(0.9, 1.1)
            cx += random.uniform(-0.05, 0.05) * size
            cy += random.uniform(-0.05, 0.05) * size
        s = self.image_size / (size * scale)
        M = cv2.getRotationMatrix2D((float(cx), float(cy)), angle, s)
        M[0, 2] += self.image_size / 2 - cx
        M[1, 2] += self.image_size / 2 - cy
        crop = cv2.warpAffine(img, M, (self.image_size, self.image_size), borderMode=cv2.BORDER_CONSTANT)
        pts_c = np.concatenate([pts, np.ones((98, 1), np.float32)], 1) @ M.T
        if self.train and random.random() < 0.3:
            crop = np.clip(crop.astype(np.float32) * random.uniform(0.7, 1.3), 0, 255).astype(np.uint8)
        inp = torch.from_numpy(crop.transpose(2, 0, 1)).float().div(255.0)
        inp = (inp - torch.tensor([0.485, 0.456, 0.406])[:, None, None]) / torch.tensor([0.229, 0.224, 0.225])[:, None, None]
        stride = self.image_size / self.heatmap_size
        target = self._gaussian(pts_c / stride)
        return inp, torch.from_numpy(target), torch.from_numpy(pts_c.astype(np.float32))


class LandmarkHRNet(nn.Module):
    def __init__(self, num_points=98):
        super().__init__()
        self.backbone = timm.create_model("hrnet_w18", pretrained=True, features_only=True, out_indices=(1, 2, 3, 4))
        chs = self.backbone.feature_info.channels()
        self.head = nn.Sequential(
            nn.Conv2d(sum(chs), 270, 1, bias=False),
            nn.BatchNorm2d(270),
            nn.ReLU(inplace=True),
            nn.Conv2d(270, num_points, 1),
        )

    def forward(self, x):
        feats = self.backbone(x)
        size = feats[0].shape[-2:]
        feats = [feats[0]] + [F.interpolate(f, size=size, mode="bilinear", align_corners=False) for f in feats[1:]]
        return self.head(torch.cat(feats, 1))


def soft_argmax_decode(hm, stride):
    n, k, h, w = hm.shape
    flat = hm.reshape(n, k, -1)
    idx = flat.argmax(-1)
    x = (idx % w).float()
    y = torch.div(idx, w, rounding_mode="floor").float()
    xi, yi = x.long(), y.long()
    valid = (xi > 0) & (xi < w - 1) & (yi > 0) & (yi < h - 1)
    b = torch.arange(n, device=hm.device)[:, None].expand(n, k)
    j = torch.arange(k, device=hm.device)[None].expand(n, k)
    xl, xr = xi.clamp(1, w - 2) - 1, xi.clamp(1, w - 2) + 1
    yu, yd = yi.clamp(1, h - 2) - 1, yi.clamp(1, h - 2) + 1
    dx = hm[b, j, yi.clamp(0, h - 1), xr] - hm[b, j, yi.clamp(0, h - 1), xl]
    dy = hm[b, j, yd, xi.clamp(0, w - 1)] - hm[b, j, yu, xi.clamp(0, w - 1)]
    x = x + torch.where(valid, dx.sign() * 0.25, torch.zeros_like(x))
    y = y + torch.where(valid, dy.sign() * 0.25, torch.zeros_like(y))
    return torch.stack([x, y], -1) * stride


@torch.no_grad()
def evaluate(model, loader, device, stride):
    model.eval()
    nme_sum, count, failures = 0.0, 0, 0
    for img, _, pts in loader:
        img, pts = img.to(device, non_blocking=True), pts.to(device, non_blocking=True)
        pred = soft_argmax_decode(model(img).float(), stride)
        interocular = torch.linalg.norm(pts[:, 60] - pts[:, 72], dim=-1)
        nme = torch.linalg.norm(pred - pts, dim=-1).mean(-1) / interocular
        nme_sum += nme.sum().item()
        failures += (nme > 0.1).sum().item()
        count += img.size(0)
    return nme_sum / count, failures / count


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=None)
    parser.add_argument("--resume", default="")
    args = parser.parse_args()
    cfg = dict(DEFAULTS)
    if args.config:
        with open(args.config) as f:
            cfg.update(yaml.safe_load(f) or {})

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    train_set = WFLW(cfg["data_root"], cfg["train_list"], cfg["image_size"], cfg["heatmap_size"], cfg["sigma"], True)
    test_set = WFLW(cfg["data_root"], cfg["test_list"], cfg["image_size"], cfg["heatmap_size"], cfg["sigma"], False)
    train_sampler = DistributedSampler(train_set)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=cfg["batch_size"], sampler=train_sampler,
                              num_workers=cfg["workers"], pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=cfg["batch_size"], sampler=test_sampler,
                             num_workers=cfg["workers"], pin_memory=True)

    model = LandmarkHRNet().to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, cfg["lr_steps"], 0.1)
    start_epoch, best_nme = 0, 1.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_nme = ckpt["epoch"], ckpt["best_nme"]

    writer = SummaryWriter(cfg["out_dir"]) if rank == 0 else None
    stride = cfg["image_size"] / cfg["heatmap_size"]
    step = start_epoch * len(train_loader)
    for epoch in range(start_epoch, cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for img, target, _ in train_loader:
            img = img.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            loss = F.mse_loss(model(img), target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if writer is not None and step % 20 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
        scheduler.step()

        nme, fr = evaluate(model, test_loader, device, stride)
        if rank == 0:
            writer.add_scalar("test/nme", nme, epoch)
            writer.add_scalar("test/fr@0.1", fr, epoch)
            print(f"epoch {epoch}  NME {nme * 100:.3f}%  FR@0.1 {fr * 100:.2f}%  ({time.time() - t0:.0f}s)", flush=True)
            is_best = nme < best_nme
            best_nme = min(nme, best_nme)
            ckpt = dict(model=model.module.state_dict(), optimizer=optimizer.state_dict(),
                        scheduler=scheduler.state_dict(), epoch=epoch + 1, best_nme=best_nme)
            torch.save(ckpt, os.path.join(cfg["out_dir"], "checkpoint.pth"))
            if is_best:
                torch.save(ckpt["model"], os.path.join(cfg["out_dir"], "model_best.pth"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
