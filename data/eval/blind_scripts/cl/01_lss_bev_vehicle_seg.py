#!/usr/bin/env python
"""Lift-Splat-Shoot: BEV vehicle segmentation from 6 nuScenes cameras.

Multi-GPU training with torchrun. Infos are produced by tools/create_lss_infos.py
(one dict per keyframe: camera paths, intrinsics, sensor2ego, BEV label png).
"""
import argparse
import logging
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

CAMS = ["CAM_FRONT_LEFT", "CAM_FRONT", "CAM_FRONT_RIGHT",
        "CAM_BACK_LEFT", "CAM_BACK", "CAM_BACK_RIGHT"]
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)

logger = logging.getLogger("lss")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--dataroot", default="/datasets/nuscenes")
    p.add_argument("--train-info", default="data/lss_infos_train.pkl")
    p.add_argument("--val-info", default="data/lss_infos_val.pkl")
    p.add_argument("--out-dir", default="work_dirs/lss_vehicle")
    p.add_argument("--epochs", type=int, default=24)
    p.add_argument("--batch-size", type=int, default=2, help="samples per GPU")
    p.add_argument("--lr", type=float, default=1e-3, help="lr for a global batch of 16")
    p.add_argument("--weight-decay", type=float, default=1e-7)
    p.add_argument("--pos-weight", type=float, default=2.13)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--final-dim", type=int, nargs=2, default=[128, 352])
    p.add_argument("--resume", default="")
    return p.parse_args()


# ----------------------------------------------------------------------------- data
class NuScenesBEVSeg(Dataset):
    def __init__(self, dataroot, info_path, final_dim, is_train):
        with open(info_path, "rb") as f:
            self.infos = pickle.load(f)
        self.dataroot = dataroot
        self.final_dim = final_dim
        self.is_train = is_train

    def __len__(self):
        return len(self.infos)

    def sample_augmentation(self, W, H):
        fH, fW = self.final_dim
        if self.is_train:
            resize = np.random.uniform(0.193, 0.225)
            rot = np.random.uniform(-5.4, 5.4)
        else:
            resize = max(fH / H, fW / W)
            rot = 0.0
        newW, newH = int(W * resize), int(H * resize)
        crop_h = int((1 - np.random.uniform(0.0, 0.22) if self.is_train else 0.0) * newH) - fH
        crop_h = max(0, min(crop_h, newH - fH))
        crop_w = int(max(0, newW - fW) / 2)
        return resize, (crop_w, crop_h, crop_w + fW, crop_h + fH), rot

    def __getitem__(self, idx):
        info = self.infos[idx]
        imgs, rots, trans, intrins, post_rots, post_trans = [], [], [], [], [], []
        for cam in CAMS:
            c = info["cams"][cam]
            img = Image.open(os.path.join(self.dataroot, c["data_path"])).convert("RGB")
            resize, crop, rot = self.sample_augmentation(*img.size)
            img = img.resize((int(img.size[0] * resize), int(img.size[1] * resize)))
            img = img.crop(crop).rotate(rot)
            post_rot = torch.eye(2) * resize
            post_tran = -torch.tensor(crop[:2], dtype=torch.float32)
            theta = rot / 180 * np.pi
            A = torch.tensor([[np.cos(theta), np.sin(theta)], [-np.sin(theta), np.cos(theta)]], dtype=torch.float32)
            b = torch.tensor([crop[2] - crop[0], crop[3] - crop[1]], dtype=torch.float32) / 2
            b = A.matmul(-b) + b
            pr, pt = torch.eye(3), torch.zeros(3)
            pr[:2, :2] = A.matmul(post_rot)
            pt[:2] = A.matmul(post_tran) + b
            arr = (np.asarray(img, dtype=np.float32) / 255.0 - MEAN) / STD
            imgs.append(torch.from_numpy(arr).permute(2, 0, 1))
            rots.append(torch.tensor(c["sensor2ego_rotation"], dtype=torch.float32))
            trans.append(torch.tensor(c["sensor2ego_translation"], dtype=torch.float32))
            intrins.append(torch.tensor(c["cam_intrinsic"], dtype=torch.float32))
            post_rots.append(pr)
            post_trans.append(pt)
        label = np.array(Image.open(os.path.join(self.dataroot, info["bev_label_path"])), dtype=np.float32)
        label = torch.from_numpy(label > 0).float().unsqueeze(0)
        return (torch.stack(imgs), torch.stack(rots), torch.stack(trans), torch.stack(intrins),
                torch.stack(post_rots), torch.stack(post_trans), label)


class ShardSampler(torch.utils.data.Sampler):
    """Strided split of the val set, no padding so every sample is scored once."""

    def __init__(self, n, rank, world_size):
        self.indices = list(range(rank, n, world_size))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


# ---------------------------------------------------------------------------- model
class Up(nn.Module):
    def __init__(self, in_ch, out_ch, scale_factor=2):
        super().__init__()
        self.up = nn.Upsample(scale_factor=scale_factor, mode="bilinear", align_corners=True)
        self.conv = nn.Sequential(
            nn.Conv2d(in_ch, out_ch, 3, padding=1, bias=False), nn.BatchNorm2d(out_ch), nn.ReLU(inplace=True),
            nn.Conv2d(out_ch, out_ch, 3, padding=1, bias=False), nn.BatchNorm2d(out_ch), nn.ReLU(inplace=True))

    def forward(self, x1, x2):
        return self.conv(torch.cat([x2, self.up(x1)], dim=1))


class CamEncode(nn.Module):
    def __init__(self, D, C):
        super().__init__()
        self.D, self.C = D, C
        trunk = torchvision.models.resnet34(weights="IMAGENET1K_V1")
        self.trunk = nn.Sequential(trunk.conv1, trunk.bn1, trunk.relu, trunk.maxpool,
                                   trunk.layer1, trunk.layer2, trunk.layer3)
        self.depthnet = nn.Conv2d(256, D + C, kernel_size=1)

    def forward(self, x):
        x = self.depthnet(self.trunk(x))
        depth = x[:, : self.D].softmax(dim=1)
        return depth.unsqueeze(1) * x[:, self.D: self.D + self.C].unsqueeze(2)


class BevEncode(nn.Module):
    def __init__(self, inC, outC):
        super().__init__()
        trunk = torchvision.models.resnet18(weights=None, zero_init_residual=True)
        self.conv1 = nn.Conv2d(inC, 64, kernel_size=7, stride=1, padding=3, bias=False)
        self.bn1, self.relu = trunk.bn1, trunk.relu
        self.layer1, self.layer2, self.layer3 = trunk.layer1, trunk.layer2, trunk.layer3
        self.up1 = Up(64 + 256, 256, scale_factor=4)
        self.up2 = nn.Sequential(
            nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True),
            nn.Conv2d(256, 128, 3, padding=1, bias=False), nn.BatchNorm2d(128), nn.ReLU(inplace=True),
            nn.Conv2d(128, outC, kernel_size=1))

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x1 = self.layer1(x)
        x = self.layer3(self.layer2(x1))
        return self.up2(self.up1(x, x1))


class LiftSplatShoot(nn.Module):
    def __init__(self, final_dim, xbound=(-50, 50, 0.5), ybound=(-50, 50, 0.5),
                 zbound=(-10, 10, 20.0), dbound=(4.0, 45.0, 1.0), C=64, downsample=16):
        super().__init__()
        bounds = [xbound, ybound, zbound]
        self.register_buffer("dx", torch.tensor([b[2] for b in bounds]), persistent=False)
        self.register_buffer("bx", torch.tensor([b[0] + b[2] / 2.0 for b in bounds]), persistent=False)
        self.nx = [int((b[1] - b[0]) / b[2]) for b in bounds]
        fH, fW = final_dim[0] // downsample, final_dim[1] // downsample
        ds = torch.arange(*dbound, dtype=torch.float).view(-1, 1, 1).expand(-1, fH, fW)
        D = ds.shape[0]
        xs = torch.linspace(0, final_dim[1] - 1, fW).view(1, 1, fW).expand(D, fH, fW)
        ys = torch.linspace(0, final_dim[0] - 1, fH).view(1, fH, 1).expand(D, fH, fW)
        self.register_buffer("frustum", torch.stack((xs, ys, ds), -1), persistent=False)
        self.C = C
        self.camencode = CamEncode(D, C)
        self.bevencode = BevEncode(inC=C * self.nx[2], outC=1)

    def get_geometry(self, rots, trans, intrins, post_rots, post_trans):
        B, N, _ = trans.shape
        pts = self.frustum - post_trans.view(B, N, 1, 1, 1, 3)
        pts = torch.inverse(post_rots).view(B, N, 1, 1, 1, 3, 3).matmul(pts.unsqueeze(-1))
        pts = torch.cat((pts[..., :2, :] * pts[..., 2:3, :], pts[..., 2:3, :]), dim=-2)
        combine = rots.matmul(torch.inverse(intrins))
        pts = combine.view(B, N, 1, 1, 1, 3, 3).matmul(pts).squeeze(-1)
        return pts + trans.view(B, N, 1, 1, 1, 3)

    def voxel_pooling(self, geom, x):
        B, N, D, H, W, C = x.shape
        x = x.reshape(-1, C)
        geom = ((geom - (self.bx - self.dx / 2.0)) / self.dx).long().view(-1, 3)
        batch_ix = torch.arange(B, device=x.device).repeat_interleave(N * D * H * W)
        nx, ny, nz = self.nx
        kept = ((geom[:, 0] >= 0) & (geom[:, 0] < nx) & (geom[:, 1] >= 0) & (geom[:, 1] < ny)
                & (geom[:, 2] >= 0) & (geom[:, 2] < nz))
        x, geom, batch_ix = x[kept], geom[kept], batch_ix[kept]
        flat = ((batch_ix * nz + geom[:, 2]) * nx + geom[:, 0]) * ny + geom[:, 1]
        bev = x.new_zeros(B * nz * nx * ny, C).index_add_(0, flat, x)
        bev = bev.view(B, nz, nx, ny, C).permute(0, 1, 4, 2, 3)
        return torch.cat(bev.unbind(dim=1), dim=1)

    def forward(self, imgs, rots, trans, intrins, post_rots, post_trans):
        B, N, _, H, W = imgs.shape
        geom = self.get_geometry(rots, trans, intrins, post_rots, post_trans)
        feats = self.camencode(imgs.view(B * N, 3, H, W))
        _, C, D, fH, fW = feats.shape
        feats = feats.view(B, N, C, D, fH, fW).permute(0, 1, 3, 4, 5, 2)
        return self.bevencode(self.voxel_pooling(geom, feats))


# ---------------------------------------------------------------------------- train
@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # intersect, union, loss_sum
    n = torch.zeros(1, device=device)
    for batch in loader:
        *inputs, label = [t.to(device, non_blocking=True) for t in batch]
        logits = model(*inputs)
        pred = logits.sigmoid() > 0.5
        tgt = label > 0.5
        stats[0] += (pred & tgt).sum()
        stats[1] += (pred | tgt).sum()
        stats[2] += F.binary_cross_entropy_with_logits(logits, label, reduction="sum") / label[0].numel()
        n += label.shape[0]
    dist.all_reduce(stats)
    dist.all_reduce(n)
    model.train()
    return (stats[0] / stats[1].clamp(min=1)).item(), (stats[2] / n).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(0)
    np.random.seed(1234 + rank)

    train_set = NuScenesBEVSeg(args.dataroot, args.train_info, args.final_dim, is_train=True)
    val_set = NuScenesBEVSeg(args.dataroot, args.val_info, args.final_dim, is_train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size,
                            sampler=ShardSampler(len(val_set), rank, world_size),
                            num_workers=args.workers, pin_memory=True)

    model = LiftSplatShoot(tuple(args.final_dim)).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    lr = args.lr * args.batch_size * world_size / 16
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=lr, total_steps=args.epochs * len(train_loader), pct_start=0.1)
    pos_weight = torch.tensor([args.pos_weight], device=device)

    start_epoch, best_iou = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_iou = ckpt["epoch"] + 1, ckpt.get("best_iou", 0.0)

    writer = None
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.out_dir, "tb"))

    step = start_epoch * len(train_loader)
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, batch in enumerate(train_loader):
            *inputs, label = [t.to(device, non_blocking=True) for t in batch]
            logits = model(*inputs)
            loss = F.binary_cross_entropy_with_logits(logits, label, pos_weight=pos_weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if step % 50 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    writer.add_scalar("train/loss", l.item(), step)
                    writer.add_scalar("train/lr", scheduler.get_last_lr()[0], step)
                    logger.info("ep %d it %d/%d loss %.4f (%.2fs/it)", epoch, i, len(train_loader),
                                l.item(), (time.time() - t0) / (i + 1))

        iou, val_loss = evaluate(model.module, val_loader, device)
        if rank == 0:
            writer.add_scalar("val/iou", iou, epoch)
            writer.add_scalar("val/loss", val_loss, epoch)
            logger.info("epoch %d val iou %.4f loss %.4f", epoch, iou, val_loss)
            ckpt = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "epoch": epoch, "best_iou": max(best_iou, iou)}
            torch.save(ckpt, os.path.join(args.out_dir, "latest.pth"))
            if iou > best_iou:
                torch.save(ckpt, os.path.join(args.out_dir, "best.pth"))
        best_iou = max(best_iou, iou)
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
