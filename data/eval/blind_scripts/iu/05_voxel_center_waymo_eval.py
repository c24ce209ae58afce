"""CenterPoint-Voxel (spconv) on Waymo, 3 classes. DDP training + distributed evaluation.

    torchrun --nproc_per_node=8 05_voxel_center_waymo_eval.py --data_root /data/waymo --epochs 30
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

from utils.waymo_metrics import center_distance_map

CLASSES = ["Vehicle", "Pedestrian", "Cyclist"]
PC_RANGE = np.array([-75.2, -75.2, -2.0, 75.2, 75.2, 4.0], np.float32)
VOXEL = np.array([0.1, 0.1, 0.15], np.float32)
GRID = np.round((PC_RANGE[3:] - PC_RANGE[:3]) / VOXEL).astype(np.int64)  # 1504, 1504, 40
STRIDE = 8
MAX_OBJS = 500


def voxelize(pts, max_pts=5, max_voxels=150000):
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
        w, l = b[4] / VOXEL[1] / STRIDE, b[3] / VOXEL[0] / STRIDE
        r = max(2, int(0.5 * math.sqrt(w * w + l * l) * 0.3))
        ys, xs = np.ogrid[-r:r + 1, -r:r + 1]
        g = np.exp(-(xs * xs + ys * ys) / (2 * ((2 * r + 1) / 6) ** 2))
        x0, x1, y0, y1 = max(cx - r, 0), min(cx + r + 1, W), max(cy - r, 0), min(cy + r + 1, H)
        hm[c, y0:y1, x0:x1] = np.maximum(hm[c, y0:y1, x0:x1], g[y0 - cy + r:y1 - cy + r, x0 - cx + r:x1 - cx + r])
        ind[k], mask[k] = cy * W + cx, 1
        reg[k] = [fx - cx, fy - cy, b[2], np.log(b[3]), np.log(b[4]), np.log(b[5]), np.sin(b[6]), np.cos(b[6])]
    return hm, reg, ind, mask


class WaymoFrames(Dataset):
    def __init__(self, root, split, training, sample_interval=1):
        self.root, self.training = root, training
        with open(os.path.join(root, f"waymo_infos_{split}.pkl"), "rb") as f:
            self.infos = pickle.load(f)[::sample_interval]

    def __len__(self):
        return len(self.infos)

    def load_points(self, info):
        pc = info["point_cloud"]
        pts = np.load(os.path.join(self.root, "waymo_processed_data", pc["lidar_sequence"], f"{pc['sample_idx']:04d}.npy"))
        pts = pts[:, :5].astype(np.float32)
        pts[:, 3] = np.tanh(pts[:, 3])
        return pts

    def gt(self, idx):
        annos = self.infos[idx]["annos"]
        keep = np.isin(annos["name"], CLASSES) & (annos["num_points_in_gt"] > 0)
        boxes = annos["gt_boxes_lidar"][keep][:, :7].astype(np.float32)
        labels = np.array([CLASSES.index(n) for n in annos["name"][keep]], np.int64)
        inr = np.all((boxes[:, :3] >= PC_RANGE[:3]) & (boxes[:, :3] < PC_RANGE[3:]), 1)
        return boxes[inr], labels[inr]

    def __getitem__(self, idx):
        pts = self.load_points(self.infos[idx])
        boxes, labels = self.gt(idx)
        if self.training:
            for axis in (0, 1):
                if np.random.rand() < 0.5:
                    pts[:, 1 - axis] *= -1
                    boxes[:, 1 - axis] *= -1
                    boxes[:, 6] = -boxes[:, 6] if axis == 0 else np.pi - boxes[:, 6]
            a = np.random.uniform(-np.pi / 4, np.pi / 4)
            R = np.array([[np.cos(a), -np.sin(a)], [np.sin(a), np.cos(a)]], np.float32)
            pts[:, :2], boxes[:, :2] = pts[:, :2] @ R.T, boxes[:, :2] @ R.T
            boxes[:, 6] += a
        pts = pts[np.all((pts[:, :3] >= PC_RANGE[:3]) & (pts[:, :3] < PC_RANGE[3:]), 1)]
        inr = np.all((boxes[:, :2] >= PC_RANGE[:2]) & (boxes[:, :2] < PC_RANGE[3:5]), 1)
        boxes, labels = boxes[inr], labels[inr]
        feats, coords = voxelize(pts)
        hm, reg, ind, mask = heat_targets(boxes, labels)
        return dict(feats=feats, coords=coords, hm=hm, reg=reg, ind=ind, mask=mask, index=idx)


def collate(batch):
    return dict(
        feats=torch.from_numpy(np.concatenate([b["feats"] for b in batch])),
        coords=torch.from_numpy(np.concatenate([np.pad(b["coords"], ((0, 0), (1, 0)), constant_values=i)
                                                for i, b in enumerate(batch)])),
        **{k: torch.from_numpy(np.stack([b[k] for b in batch])) for k in ("hm", "reg", "ind", "mask")},
        index=torch.tensor([b["index"] for b in batch]), batch_size=len(batch))


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
            sp_block(5, 16, "subm1"), sp_block(16, 16, "subm1"),
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
def decode(hm_logits, reg_map, index, topk=300, thr=0.1):
    """Returns (N, 10) rows: frame index, x, y, z, l, w, h, yaw, score, label."""
    B, C, H, W = hm_logits.shape
    heat = hm_logits.sigmoid()
    heat = heat * (F.max_pool2d(heat, 3, 1, 1) == heat)
    scores, idx = heat.flatten(1).topk(topk)
    cls, pix = idx // (H * W), idx % (H * W)
    r = gather_at(reg_map, pix)
    x = ((pix % W).float() + r[..., 0]) * STRIDE * VOXEL[0] + PC_RANGE[0]
    y = ((pix // W).float() + r[..., 1]) * STRIDE * VOXEL[1] + PC_RANGE[1]
    rows = torch.stack([index[:, None].expand(-1, topk).float().to(x.device), x, y, r[..., 2], r[..., 3].exp(),
                        r[..., 4].exp(), r[..., 5].exp(), torch.atan2(r[..., 6], r[..., 7]), scores, cls.float()], -1)
    rows = rows.flatten(0, 1)
    return rows[rows[:, 8] > thr]


@torch.no_grad()
def evaluate(model, loader, val_set, device):
    model.eval()
    dets = [torch.zeros(0, 10, device=device)]
    for batch in loader:
        hm_logits, reg_map = model(batch["feats"].to(device), batch["coords"].to(device), batch["batch_size"])
        dets.append(decode(hm_logits, reg_map, batch["index"]))
    local = torch.cat(dets)
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    model.train()
    if dist.get_rank() != 0:
        return None
    dets = torch.cat(gathered).cpu().numpy()
    gts = {i: val_set.gt(i) for i in range(len(val_set))}
    return center_distance_map(dets, gts, num_classes=len(CLASSES), thresholds=(0.5, 1.0, 2.0, 4.0))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_root", default="/data/waymo")
    ap.add_argument("--out", default="runs/cp_voxel_waymo")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--train_interval", type=int, default=5, help="use every k-th frame (20% subset by default)")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    np.random.seed(rank)

    train_set = WaymoFrames(args.data_root, "train", True, args.train_interval)
    val_set = WaymoFrames(args.data_root, "val", False, 5)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, args.bs, sampler=sampler, num_workers=args.workers, collate_fn=collate,
                        pin_memory=True, drop_last=True)
    # strided shard so that no frame is evaluated twice
    val_loader = DataLoader(Subset(val_set, list(range(rank, len(val_set), world))), args.bs,
                            num_workers=args.workers, collate_fn=collate)

    model = DDP(nn.SyncBatchNorm.convert_sync_batchnorm(CenterPointVoxel()).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, total_steps=args.epochs * len(loader), pct_start=0.4)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for it, batch in enumerate(loader):
            batch = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
            hm_logits, reg_map = model(batch["feats"], batch["coords"], batch["batch_size"])
            l_hm, l_reg = losses(hm_logits, reg_map, batch)
            loss = l_hm + 2.0 * l_reg
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10)
            opt.step()
            sched.step()
            if it % 100 == 0:
                logged = torch.stack([l_hm.detach(), l_reg.detach()])
                dist.all_reduce(logged, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} it {it}/{len(loader)} hm {logged[0]:.4f} reg {logged[1]:.4f} "
                          f"{(time.time() - t0) / (it + 1):.2f}s/it", flush=True)
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(args.out, "latest.pth"))
        if (epoch + 1) % 10 == 0 or epoch + 1 == args.epochs:
            res = evaluate(model.module, val_loader, val_set, device)
            if rank == 0:
                print(f"epoch {epoch} mAP " + " ".join(f"{c}={res[c]:.4f}" for c in CLASSES), flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
