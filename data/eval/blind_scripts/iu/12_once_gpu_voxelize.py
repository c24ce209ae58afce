"""CenterPoint-Voxel on the ONCE dataset (roof LiDAR), voxelization with spconv's PointToVoxel on the GPU.

    torchrun --nproc_per_node=8 12_once_gpu_voxelize.py --data_root /data/once --batch_size 4
"""
import argparse
import math
import os
import pickle
import time

import numpy as np
import spconv.pytorch as spconv
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from spconv.pytorch.utils import PointToVoxel
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from once_devkit.eval import once_center_ap

CLASSES = ["Car", "Bus", "Truck", "Pedestrian", "Cyclist"]
PC_RANGE = np.array([-75.2, -75.2, -5.0, 75.2, 75.2, 3.0], np.float32)
VOXEL = np.array([0.1, 0.1, 0.2], np.float32)
GRID = np.round((PC_RANGE[3:] - PC_RANGE[:3]) / VOXEL).astype(np.int64)  # 1504, 1504, 40
STRIDE = 8
MAX_OBJS = 500


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


class OnceDataset(Dataset):
    def __init__(self, root, split, training, device):
        self.root, self.training = root, training
        with open(os.path.join(root, f"once_infos_{split}.pkl"), "rb") as f:
            self.infos = [i for i in pickle.load(f) if "annos" in i]
        self.device = device
        self.voxel_gen = PointToVoxel(vsize_xyz=VOXEL.tolist(), coors_range_xyz=PC_RANGE.tolist(), num_point_features=4,
                                      max_num_voxels=150000 if training else 200000, max_num_points_per_voxel=5,
                                      device=device)

    def __len__(self):
        return len(self.infos)

    def __getitem__(self, idx):
        info = self.infos[idx]
        pts = np.fromfile(os.path.join(self.root, "data", info["sequence_id"], "lidar_roof", f"{info['frame_id']}.bin"),
                          np.float32).reshape(-1, 4)
        keep = np.isin(info["annos"]["name"], CLASSES)
        boxes = info["annos"]["boxes_3d"][keep].astype(np.float32)
        labels = np.array([CLASSES.index(n) for n in info["annos"]["name"][keep]], np.int64)
        if self.training:
            if np.random.rand() < 0.5:
                pts[:, 1], boxes[:, 1], boxes[:, 6] = -pts[:, 1], -boxes[:, 1], -boxes[:, 6]
            if np.random.rand() < 0.5:
                pts[:, 0], boxes[:, 0], boxes[:, 6] = -pts[:, 0], -boxes[:, 0], np.pi - boxes[:, 6]
            a = np.random.uniform(-np.pi / 4, np.pi / 4)
            R = np.array([[np.cos(a), -np.sin(a)], [np.sin(a), np.cos(a)]], np.float32)
            pts[:, :2], boxes[:, :2], boxes[:, 6] = pts[:, :2] @ R.T, boxes[:, :2] @ R.T, boxes[:, 6] + a
            s = np.random.uniform(0.95, 1.05)
            pts[:, :3], boxes[:, :6] = pts[:, :3] * s, boxes[:, :6] * s
        inr = np.all((boxes[:, :2] >= PC_RANGE[:2]) & (boxes[:, :2] < PC_RANGE[3:5]), 1)
        boxes, labels = boxes[inr], labels[inr]
        voxels, coords, num = self.voxel_gen(torch.from_numpy(pts).to(self.device))
        hm, reg, ind, mask = heat_targets(boxes, labels)
        return dict(voxels=voxels.cpu(), coords=coords.cpu(), num=num.cpu(), hm=hm, reg=reg, ind=ind, mask=mask,
                    frame_id=info["frame_id"], gt_boxes=boxes, gt_labels=labels)


def collate(batch):
    out = {"voxels": torch.cat([b["voxels"] for b in batch]), "num": torch.cat([b["num"] for b in batch]),
           "coords": torch.cat([F.pad(b["coords"], (1, 0), value=i) for i, b in enumerate(batch)]),
           "frame_id": [b["frame_id"] for b in batch], "gt": [(b["gt_boxes"], b["gt_labels"]) for b in batch],
           "batch_size": len(batch)}
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

    def forward(self, voxels, num_points, coords, batch_size):
        feats = voxels.sum(1) / num_points.clamp(min=1).unsqueeze(1).type_as(voxels)  # mean VFE
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
    ap.add_argument("--data_root", default="/data/once")
    ap.add_argument("--out_dir", default="runs/once_centerpoint")
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--workers", type=int, default=4)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    np.random.seed(rank)

    train_set = OnceDataset(args.data_root, "train", True, device)
    val_set = OnceDataset(args.data_root, "val", False, device)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.workers, collate_fn=collate,
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, args.batch_size, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=args.workers, collate_fn=collate)

    model = DDP(nn.SyncBatchNorm.convert_sync_batchnorm(CenterPointVoxel()).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, total_steps=args.epochs * len(loader), pct_start=0.4)
    writer = SummaryWriter(args.out_dir) if rank == 0 else None

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, batch in enumerate(loader):
            batch = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
            hm_logits, reg_map = model(batch["voxels"], batch["num"], batch["coords"], batch["batch_size"])
            l_hm, l_reg = losses(hm_logits, reg_map, batch)
            opt.zero_grad(set_to_none=True)
            (l_hm + 2.0 * l_reg).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10)
            opt.step()
            sched.step()
            if it % 50 == 0:
                logged = torch.stack([l_hm.detach(), l_reg.detach()])
                dist.all_reduce(logged, op=dist.ReduceOp.AVG)
                if rank == 0:
                    step = epoch * len(loader) + it
                    writer.add_scalar("loss/hm", logged[0].item(), step)
                    writer.add_scalar("loss/reg", logged[1].item(), step)
                    print(f"epoch {epoch} it {it}/{len(loader)} hm {logged[0]:.4f} reg {logged[1]:.4f} "
                          f"{(time.time() - t0) / (it + 1):.2f}s/it", flush=True)

        if (epoch + 1) % 10 == 0 or epoch + 1 == args.epochs:
            net = model.module.eval()
            dets = {}
            with torch.no_grad():
                for batch in val_loader:
                    hm_logits, reg_map = net(batch["voxels"].to(device), batch["num"].to(device),
                                             batch["coords"].to(device), batch["batch_size"])
                    for fid, gt, pred in zip(batch["frame_id"], batch["gt"], decode(hm_logits, reg_map)):
                        dets[fid] = (pred, gt)
            net.train()
            parts = [None] * world
            dist.all_gather_object(parts, dets)
            if rank == 0:
                merged = {k: v for p in parts for k, v in p.items()}
                aps = once_center_ap(merged, num_classes=len(CLASSES))
                for c, a in zip(CLASSES, aps):
                    writer.add_scalar(f"val/AP_{c}", a, epoch)
                print(f"epoch {epoch} " + " ".join(f"{c}={a:.4f}" for c, a in zip(CLASSES, aps)), flush=True)
                torch.save({"model": model.module.state_dict(), "epoch": epoch},
                           os.path.join(args.out_dir, f"epoch_{epoch + 1}.pth"))
            dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
