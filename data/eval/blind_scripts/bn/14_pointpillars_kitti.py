"""
PointPillars (car only) on KITTI with an anchor-free center head.
Voxelization runs on the GPU through mmcv.ops.Voxelization.

    torchrun --nproc_per_node=4 tools/train_pillars.py --root data/kitti --work_dir work_dirs/pillars_car
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
from mmcv.ops import Voxelization
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

POINT_RANGE = [0, -39.68, -3, 69.12, 39.68, 1]
PILLAR = [0.16, 0.16, 4]


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="data/kitti")
    ap.add_argument("--work_dir", default="work_dirs/pillars_car")
    ap.add_argument("--samples_per_gpu", type=int, default=6)
    ap.add_argument("--workers_per_gpu", type=int, default=4)
    ap.add_argument("--max_epochs", type=int, default=160)
    ap.add_argument("--lr", type=float, default=0.001, help="per 24 samples")
    ap.add_argument("--resume_from", default=None)
    return ap.parse_args()


class KittiCar(Dataset):
    def __init__(self, root, split, training):
        with open(os.path.join(root, f"kitti_infos_{split}.pkl"), "rb") as f:
            self.infos = pickle.load(f)
        self.root, self.training = root, training

    def __len__(self):
        return len(self.infos)

    def __getitem__(self, i):
        info = self.infos[i]
        idx = info["image"]["image_idx"]
        pts = np.fromfile(os.path.join(self.root, "training", "velodyne_reduced", f"{idx:06d}.bin"),
                          dtype=np.float32).reshape(-1, 4)
        annos = info["annos"]
        boxes = annos["gt_boxes_lidar"][annos["name"] == "Car"].astype(np.float32)
        if self.training:
            if np.random.rand() < 0.5:
                pts[:, 1] = -pts[:, 1]
                boxes[:, 1] = -boxes[:, 1]
                boxes[:, 6] = -boxes[:, 6]
            noise = np.random.normal(0, 0.2, 3).astype(np.float32)
            pts[:, :3] += noise
            boxes[:, :3] += noise
        return torch.from_numpy(pts), torch.from_numpy(boxes), idx


def collate(batch):
    pts, boxes, idx = zip(*batch)
    return list(pts), list(boxes), list(idx)


class PillarFeatureNet(nn.Module):
    def __init__(self, in_ch=9, out_ch=64):
        super().__init__()
        self.linear = nn.Linear(in_ch, out_ch, bias=False)
        self.norm = nn.BatchNorm1d(out_ch, eps=1e-3, momentum=0.01)

    def forward(self, voxels, num_points, coors):
        pts_mean = voxels[:, :, :3].sum(1, keepdim=True) / num_points.view(-1, 1, 1).clamp(min=1)
        f_cluster = voxels[:, :, :3] - pts_mean
        center = coors[:, [3, 2]].float() * torch.tensor(PILLAR[:2], device=voxels.device) + \
            torch.tensor([PILLAR[0] / 2 + POINT_RANGE[0], PILLAR[1] / 2 + POINT_RANGE[1]], device=voxels.device)
        f_center = voxels[:, :, :2] - center.unsqueeze(1)
        x = torch.cat([voxels, f_cluster, f_center], -1)
        mask = (torch.arange(voxels.shape[1], device=voxels.device).view(1, -1) < num_points.view(-1, 1)).float()
        x = x * mask.unsqueeze(-1)
        x = F.relu(self.norm(self.linear(x).permute(0, 2, 1)).permute(0, 2, 1))
        return x.max(1)[0]


class PointPillarsCenter(nn.Module):
    def __init__(self):
        super().__init__()
        self.voxelize = Voxelization(PILLAR, POINT_RANGE, max_num_points=32, max_voxels=(16000, 40000))
        self.pfn = PillarFeatureNet()
        self.nx = int(round((POINT_RANGE[3] - POINT_RANGE[0]) / PILLAR[0]))
        self.ny = int(round((POINT_RANGE[4] - POINT_RANGE[1]) / PILLAR[1]))

        def stage(cin, cout, n, stride):
            layers = [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout, eps=1e-3), nn.ReLU()]
            for _ in range(n):
                layers += [nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout, eps=1e-3), nn.ReLU()]
            return nn.Sequential(*layers)

        self.b1, self.b2, self.b3 = stage(64, 64, 3, 2), stage(64, 128, 5, 2), stage(128, 256, 5, 2)
        self.u1 = nn.Sequential(nn.ConvTranspose2d(64, 128, 1, 1, bias=False), nn.BatchNorm2d(128), nn.ReLU())
        self.u2 = nn.Sequential(nn.ConvTranspose2d(128, 128, 2, 2, bias=False), nn.BatchNorm2d(128), nn.ReLU())
        self.u3 = nn.Sequential(nn.ConvTranspose2d(256, 128, 4, 4, bias=False), nn.BatchNorm2d(128), nn.ReLU())
        self.hm = nn.Conv2d(384, 1, 1)
        self.reg = nn.Conv2d(384, 8, 1)
        nn.init.constant_(self.hm.bias, -2.19)

    def forward(self, points):
        voxels, coors, npts = [], [], []
        for i, p in enumerate(points):
            v, c, n = self.voxelize(p)
            voxels.append(v)
            coors.append(F.pad(c, (1, 0), value=i))
            npts.append(n)
        voxels, coors, npts = torch.cat(voxels), torch.cat(coors), torch.cat(npts)
        feats = self.pfn(voxels, npts, coors)
        canvas = feats.new_zeros(len(points), 64, self.ny * self.nx)
        canvas[coors[:, 0].long(), :, (coors[:, 2] * self.nx + coors[:, 3]).long()] = feats
        x = canvas.view(len(points), 64, self.ny, self.nx)
        x1 = self.b1(x)
        x2 = self.b2(x1)
        x3 = self.b3(x2)
        x = torch.cat([self.u1(x1), self.u2(x2), self.u3(x3)], 1)
        return self.hm(x), self.reg(x)


def center_targets(boxes, shape, device, stride=2):
    b, _, h, w = shape
    hm = torch.zeros(b, 1, h, w, device=device)
    reg = torch.zeros(b, 8, h, w, device=device)
    ind = torch.zeros(b, h, w, dtype=torch.bool, device=device)
    cell = PILLAR[0] * stride
    ys, xs = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    for i, bx in enumerate(boxes):
        for box in bx.tolist():
            fx, fy = (box[0] - POINT_RANGE[0]) / cell, (box[1] - POINT_RANGE[1]) / cell
            cx, cy = int(fx), int(fy)
            if 0 <= cx < w and 0 <= cy < h:
                hm[i, 0] = torch.maximum(hm[i, 0], torch.exp(-((xs - cx) ** 2 + (ys - cy) ** 2) / 8.0))
                reg[i, :, cy, cx] = torch.tensor([fx - cx, fy - cy, box[2], np.log(box[3]), np.log(box[4]),
                                                  np.log(box[5]), np.sin(box[6]), np.cos(box[6])], device=device)
                ind[i, cy, cx] = True
    return hm, reg, ind


def focal_loss(pred, gt):
    pred = pred.sigmoid().clamp(1e-4, 1 - 1e-4)
    pos = gt.eq(1).float()
    pos_l = (torch.log(pred) * (1 - pred) ** 2 * pos).sum()
    neg_l = (torch.log(1 - pred) * pred ** 2 * (1 - gt) ** 4 * (1 - pos)).sum()
    return -(pos_l + neg_l) / pos.sum().clamp(min=1)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logger = logging.getLogger("pillars")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, format="%(asctime)s - %(message)s")
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)
        logger.addHandler(logging.FileHandler(os.path.join(args.work_dir, "train.log")))

    train_set = KittiCar(args.root, "train", training=True)
    val_set = KittiCar(args.root, "val", training=False)
    train_loader = DataLoader(train_set, batch_size=args.samples_per_gpu, shuffle=True,
                              num_workers=args.workers_per_gpu, collate_fn=collate, drop_last=True, pin_memory=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world_size)),
                            batch_size=args.samples_per_gpu, num_workers=args.workers_per_gpu, collate_fn=collate)

    model = PointPillarsCenter()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank])
    lr = args.lr * args.samples_per_gpu * world_size / 24
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.95, 0.99), weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr * 10,
                                                    total_steps=args.max_epochs * len(train_loader))
    start_epoch = 0
    if args.resume_from:
        ckpt = torch.load(args.resume_from, map_location="cpu")
        model.module.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"]

    for epoch in range(start_epoch, args.max_epochs):
        model.train()
        t0 = time.time()
        for it, (pts, boxes, _) in enumerate(train_loader):
            pts = [p.to(device, non_blocking=True) for p in pts]
            hm, reg = model(pts)
            hm_t, reg_t, ind = center_targets(boxes, hm.shape, device)
            l_hm = focal_loss(hm, hm_t)
            l_reg = F.smooth_l1_loss(reg.permute(0, 2, 3, 1)[ind], reg_t.permute(0, 2, 3, 1)[ind], reduction="sum") \
                / ind.sum().clamp(min=1)
            loss = l_hm + 2.0 * l_reg
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 35)
            optimizer.step()
            scheduler.step()
            if it % 50 == 0:
                logger.info(f"Epoch [{epoch + 1}][{it}/{len(train_loader)}] lr: {scheduler.get_last_lr()[0]:.3e} "
                            f"loss_hm: {l_hm.item():.4f} loss_reg: {l_reg.item():.4f} time: {time.time() - t0:.1f}")

        # quick validation: heatmap focal loss on the held-out split
        model.eval()
        val = torch.zeros(2, device=device)
        with torch.no_grad():
            for pts, boxes, _ in val_loader:
                hm, reg = model.module([p.to(device) for p in pts])
                hm_t, _, _ = center_targets(boxes, hm.shape, device)
                val += torch.stack([focal_loss(hm, hm_t) * len(pts), torch.tensor(float(len(pts)), device=device)])
        dist.all_reduce(val)
        logger.info(f"Epoch [{epoch + 1}] val loss_hm: {(val[0] / val[1]).item():.4f}")

        if rank == 0:
            torch.save({"epoch": epoch + 1, "state_dict": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
                       os.path.join(args.work_dir, f"epoch_{epoch + 1}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
