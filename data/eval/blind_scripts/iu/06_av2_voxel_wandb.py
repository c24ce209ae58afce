"""Voxel CenterPoint on Argoverse 2 (sensor dataset, top LiDAR), tracked in Weights & Biases.

    torchrun --nproc_per_node=8 06_av2_voxel_wandb.py --data_root /data/av2 --run_name cp_av2_r1
"""
import argparse
import math
import os
import pickle
import time

import numpy as np
import pandas as pd
import spconv.pytorch as spconv
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from av2_tools.eval import av2_center_map

CLASSES = ["REGULAR_VEHICLE", "PEDESTRIAN", "BICYCLIST", "MOTORCYCLIST", "LARGE_VEHICLE", "BUS", "BOX_TRUCK"]
PC_RANGE = np.array([-76.8, -76.8, -3.0, 76.8, 76.8, 3.0], np.float32)
VOXEL = np.array([0.1, 0.1, 0.15], np.float32)
GRID = np.round((PC_RANGE[3:] - PC_RANGE[:3]) / VOXEL).astype(np.int64)  # 1536, 1536, 40
STRIDE = 8
MAX_OBJS = 500


def voxelize(pts, max_pts=5, max_voxels=160000):
    ijk = ((pts[:, :3] - PC_RANGE[:3]) / VOXEL).astype(np.int64)
    key = (ijk[:, 2] * GRID[1] + ijk[:, 1]) * GRID[0] + ijk[:, 0]
    order = np.argsort(key, kind="stable")
    pts, ijk, key = pts[order], ijk[order], key[order]
    _, first, cnt = np.unique(key, return_index=True, return_counts=True)
    slot = np.arange(len(key)) - np.repeat(first, cnt)
    vid = np.repeat(np.arange(len(first)), cnt)
    ok = slot < max_pts
    vox = np.zeros((len(first), max_pts, pts.shape[1]), np.float32)
    vox[vid[ok], slot[ok]] = pts[ok]
    feats = vox.sum(1) / np.minimum(cnt, max_pts)[:, None]  # mean VFE done on CPU
    zyx = ijk[first][:, ::-1].astype(np.int32)
    if len(first) > max_voxels:
        sel = np.random.choice(len(first), max_voxels, replace=False)
        feats, zyx = feats[sel], zyx[sel]
    return feats.astype(np.float32), zyx


def heat_targets(boxes, labels):
    H, W = int(GRID[1]) // STRIDE, int(GRID[0]) // STRIDE
    hm = np.zeros((len(CLASSES), H, W), np.float32)
    reg = np.zeros((MAX_OBJS, 8), np.float32)
    ind = np.zeros(MAX_OBJS, np.int64)
    mask = np.zeros(MAX_OBJS, np.float32)
    for k, (b, c) in enumerate(zip(boxes[:MAX_OBJS], labels)):
        fx, fy = (b[0] - PC_RANGE[0]) / VOXEL[0] / STRIDE, (b[1] - PC_RANGE[1]) / VOXEL[1] / STRIDE
        cx, cy = int(fx), int(fy)
        if not (0 <= cx < W and 0 <= cy < H):
            continue
        r = max(2, int(0.3 * math.hypot(b[3], b[4]) / VOXEL[0] / STRIDE))
        ys, xs = np.ogrid[-r:r + 1, -r:r + 1]
        g = np.exp(-(xs * xs + ys * ys) / (2 * ((2 * r + 1) / 6) ** 2))
        x0, x1, y0, y1 = max(cx - r, 0), min(cx + r + 1, W), max(cy - r, 0), min(cy + r + 1, H)
        hm[c, y0:y1, x0:x1] = np.maximum(hm[c, y0:y1, x0:x1], g[y0 - cy + r:y1 - cy + r, x0 - cx + r:x1 - cx + r])
        ind[k], mask[k] = cy * W + cx, 1
        reg[k] = [fx - cx, fy - cy, b[2], np.log(b[3]), np.log(b[4]), np.log(b[5]), np.sin(b[6]), np.cos(b[6])]
    return hm, reg, ind, mask


class AV2Frames(Dataset):
    def __init__(self, root, split, training):
        self.root, self.training = root, training
        with open(os.path.join(root, f"av2_infos_{split}.pkl"), "rb") as f:
            self.infos = pickle.load(f)

    def __len__(self):
        return len(self.infos)

    def __getitem__(self, idx):
        info = self.infos[idx]
        df = pd.read_feather(os.path.join(self.root, info["lidar_path"]), columns=["x", "y", "z", "intensity"])
        pts = df.to_numpy(np.float32)
        pts[:, 3] /= 255.0
        keep = np.isin(info["gt_names"], CLASSES) & (info["num_interior_pts"] > 0)
        boxes = info["gt_boxes"][keep].astype(np.float32)
        labels = np.array([CLASSES.index(n) for n in info["gt_names"][keep]], np.int64)
        if self.training:
            if np.random.rand() < 0.5:
                pts[:, 1], boxes[:, 1], boxes[:, 6] = -pts[:, 1], -boxes[:, 1], -boxes[:, 6]
            a = np.random.uniform(-np.pi / 4, np.pi / 4)
            R = np.array([[np.cos(a), -np.sin(a)], [np.sin(a), np.cos(a)]], np.float32)
            pts[:, :2], boxes[:, :2], boxes[:, 6] = pts[:, :2] @ R.T, boxes[:, :2] @ R.T, boxes[:, 6] + a
        pts = pts[np.all((pts[:, :3] >= PC_RANGE[:3]) & (pts[:, :3] < PC_RANGE[3:]), 1)]
        inr = np.all((boxes[:, :2] >= PC_RANGE[:2]) & (boxes[:, :2] < PC_RANGE[3:5]), 1)
        boxes, labels = boxes[inr], labels[inr]
        feats, coords = voxelize(pts)
        hm, reg, ind, mask = heat_targets(boxes, labels)
        return dict(feats=feats, coords=coords, hm=hm, reg=reg, ind=ind, mask=mask, token=info["token"],
                    gt=(boxes, labels))


def collate(batch):
    out = {"feats": torch.from_numpy(np.concatenate([b["feats"] for b in batch])),
           "coords": torch.from_numpy(np.concatenate([np.pad(b["coords"], ((0, 0), (1, 0)), constant_values=i)
                                                      for i, b in enumerate(batch)])),
           "tokens": [b["token"] for b in batch], "gt": [b["gt"] for b in batch], "batch_size": len(batch)}
    for k in ("hm", "reg", "ind", "mask"):
        out[k] = torch.from_numpy(np.stack([b[k] for b in batch]))
    return out


def sp_block(cin, cout, key, stride=1, padding=1, subm=True, k=3):
    conv = (spconv.SubMConv3d(cin, cout, k, padding=padding, bias=False, indice_key=key) if subm else
            spconv.SparseConv3d(cin, cout, k, stride=stride, padding=padding, bias=False, indice_key=key))
    return spconv.SparseSequential(conv, nn.BatchNorm1d(cout, eps=1e-3, momentum=0.01), nn.ReLU(inplace=True))


def conv2d(cin, cout, stride=1):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout, eps=1e-3, momentum=0.01),
                         nn.ReLU(inplace=True))


class CenterPointVoxel(nn.Module):
    def __init__(self):
        super().__init__()
        self.shape = [int(GRID[2]) + 1, int(GRID[1]), int(GRID[0])]
        self.sparse = spconv.SparseSequential(
            sp_block(4, 16, "subm1"), sp_block(16, 16, "subm1"),
            sp_block(16, 32, "down1", 2, 1, False), sp_block(32, 32, "subm2"), sp_block(32, 32, "subm2"),
            sp_block(32, 64, "down2", 2, 1, False), sp_block(64, 64, "subm3"), sp_block(64, 64, "subm3"),
            sp_block(64, 128, "down3", 2, (0, 1, 1), False), sp_block(128, 128, "subm4"), sp_block(128, 128, "subm4"),
            sp_block(128, 128, "down4", (2, 1, 1), 0, False, (3, 1, 1)),
        )
        self.bev1 = nn.Sequential(conv2d(256, 128), *[conv2d(128, 128) for _ in range(5)])
        self.bev2 = nn.Sequential(conv2d(128, 256, 2), *[conv2d(256, 256) for _ in range(5)])
        self.up1 = nn.Sequential(nn.Conv2d(128, 256, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU(inplace=True))
        self.up2 = nn.Sequential(nn.ConvTranspose2d(256, 256, 2, 2, bias=False), nn.BatchNorm2d(256), nn.ReLU(inplace=True))
        self.shared = conv2d(512, 64)
        self.hm = nn.Sequential(conv2d(64, 64), nn.Conv2d(64, len(CLASSES), 1))
        self.reg = nn.Sequential(conv2d(64, 64), nn.Conv2d(64, 8, 1))
        self.hm[-1].bias.data.fill_(-2.19)

    def forward(self, feats, coords, batch_size):
        x = spconv.SparseConvTensor(feats, coords.int(), self.shape, batch_size)
        x = self.sparse(x).dense().flatten(1, 2)
        x1 = self.bev1(x)
        x = self.shared(torch.cat([self.up1(x1), self.up2(self.bev2(x1))], 1))
        return self.hm(x), self.reg(x)


def gather_at(fmap, ind):
    B, C = fmap.shape[:2]
    return fmap.flatten(2).gather(2, ind.unsqueeze(1).expand(-1, C, -1)).transpose(1, 2)


def losses(hm_logits, reg_map, batch):
    p = hm_logits.sigmoid().clamp(1e-4, 1 - 1e-4)
    gt = batch["hm"]
    pos = gt.eq(1).float()
    focal = -(torch.log(p) * (1 - p) ** 2 * pos + torch.log(1 - p) * p ** 2 * (1 - gt) ** 4 * (1 - pos)).sum()
    focal = focal / pos.sum().clamp(min=1)
    m = batch["mask"].unsqueeze(-1)
    l1 = (F.l1_loss(gather_at(reg_map, batch["ind"]) * m, batch["reg"] * m, reduction="sum") /
          (m.sum() * 8).clamp(min=1))
    return focal, l1


@torch.no_grad()
def decode(hm_logits, reg_map, topk=300, thr=0.1):
    B, C, H, W = hm_logits.shape
    heat = hm_logits.sigmoid()
    heat = heat * (F.max_pool2d(heat, 3, 1, 1) == heat)
    scores, idx = heat.flatten(1).topk(topk)
    cls, pix = idx // (H * W), idx % (H * W)
    r = gather_at(reg_map, pix)
    x = ((pix % W).float() + r[..., 0]) * STRIDE * VOXEL[0] + PC_RANGE[0]
    y = ((pix // W).float() + r[..., 1]) * STRIDE * VOXEL[1] + PC_RANGE[1]
    boxes = torch.stack([x, y, r[..., 2], r[..., 3].exp(), r[..., 4].exp(), r[..., 5].exp(),
                         torch.atan2(r[..., 6], r[..., 7])], -1)
    return [(boxes[b][scores[b] > thr].cpu().numpy(), scores[b][scores[b] > thr].cpu().numpy(),
             cls[b][scores[b] > thr].cpu().numpy()) for b in range(B)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_root", default="/data/av2")
    ap.add_argument("--run_name", default="cp_voxel_av2")
    ap.add_argument("--out_dir", default="runs")
    ap.add_argument("--epochs", type=int, default=24)
    ap.add_argument("--batch_size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--workers", type=int, default=6)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    np.random.seed(rank)

    run = wandb.init(project="av2-lidar-detection", name=args.run_name, config={**vars(args), "world_size": world})

    train_set, val_set = AV2Frames(args.data_root, "train", True), AV2Frames(args.data_root, "val", False)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.workers, collate_fn=collate,
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, args.batch_size, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=args.workers, collate_fn=collate)

    model = DDP(nn.SyncBatchNorm.convert_sync_batchnorm(CenterPointVoxel()).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, total_steps=args.epochs * len(loader), pct_start=0.4)
    ckpt_dir = os.path.join(args.out_dir, args.run_name)
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, batch in enumerate(loader):
            batch = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
            hm_logits, reg_map = model(batch["feats"], batch["coords"], batch["batch_size"])
            l_hm, l_reg = losses(hm_logits, reg_map, batch)
            opt.zero_grad(set_to_none=True)
            (l_hm + 2.0 * l_reg).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10)
            opt.step()
            sched.step()
            step += 1
            if step % 20 == 0:
                s = torch.stack([l_hm.detach(), l_reg.detach()])
                dist.all_reduce(s, op=dist.ReduceOp.AVG)
                wandb.log({"train/loss_hm": s[0].item(), "train/loss_reg": s[1].item(),
                           "train/lr": sched.get_last_lr()[0], "epoch": epoch}, step=step)
                if rank == 0 and step % 200 == 0:
                    print(f"epoch {epoch} it {it}/{len(loader)} hm {s[0]:.4f} reg {s[1]:.4f} "
                          f"{(time.time() - t0) / (it + 1):.2f}s/it", flush=True)

        if (epoch + 1) % 4 == 0 or epoch + 1 == args.epochs:
            net = model.module.eval()
            dets = {}
            with torch.no_grad():
                for batch in val_loader:
                    hm_logits, reg_map = net(batch["feats"].to(device), batch["coords"].to(device), batch["batch_size"])
                    for tok, gt, pred in zip(batch["tokens"], batch["gt"], decode(hm_logits, reg_map)):
                        dets[tok] = (pred, gt)
            net.train()
            parts = [None] * world
            dist.all_gather_object(parts, dets)
            if rank == 0:
                merged = {k: v for p in parts for k, v in p.items()}
                m_ap, per_class = av2_center_map(merged, CLASSES)
                wandb.log({"val/mAP": m_ap, **{f"val/AP_{c}": a for c, a in per_class.items()}}, step=step)
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "wandb_id": run.id},
                           os.path.join(ckpt_dir, f"epoch_{epoch + 1}.pth"))
            dist.barrier()

    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
