"""CenterPoint (VoxelNet backbone, 6 task heads) on nuScenes with gradient accumulation.

    torchrun --nproc_per_node=8 13_centerpoint_multihead.py --root /data/nuscenes --accum 2
"""
import argparse
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
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from det3d_lite.augment import GTDatabaseSampler, random_flip_bev, global_rot_scale
from det3d_lite.nusc_eval import nusc_center_map

TASKS = [["car"], ["truck", "construction_vehicle"], ["bus", "trailer"], ["barrier"],
         ["motorcycle", "bicycle"], ["pedestrian", "traffic_cone"]]
CLASSES = [c for t in TASKS for c in t]
PC_RANGE = np.array([-51.2, -51.2, -5.0, 51.2, 51.2, 3.0], np.float32)
VOXEL = np.array([0.1, 0.1, 0.2], np.float32)
GRID = np.round((PC_RANGE[3:] - PC_RANGE[:3]) / VOXEL).astype(np.int64)
STRIDE, MAX_OBJS, N_REG = 8, 500, 10


def load_sweeps(root, info, nsweeps=10):
    pts = np.fromfile(os.path.join(root, info["lidar_path"]), np.float32).reshape(-1, 5)[:, :4]
    clouds = [np.hstack([pts, np.zeros((len(pts), 1), np.float32)])]
    for sw in info["sweeps"][:nsweeps - 1]:
        p = np.fromfile(os.path.join(root, sw["lidar_path"]), np.float32).reshape(-1, 5)[:, :4]
        p = p[np.hypot(p[:, 0], p[:, 1]) > 1.0]  # drop ego-vehicle returns
        if sw.get("transform_matrix") is not None:
            p[:, :3] = p[:, :3] @ sw["transform_matrix"][:3, :3].T + sw["transform_matrix"][:3, 3]
        clouds.append(np.hstack([p, np.full((len(p), 1), sw["time_lag"], np.float32)]))
    return np.concatenate(clouds)


def voxelize(pts, max_pts=10, max_voxels=90000):
    ijk = ((pts[:, :3] - PC_RANGE[:3]) / VOXEL).astype(np.int64)
    key = (ijk[:, 2] * GRID[1] + ijk[:, 1]) * GRID[0] + ijk[:, 0]
    order = np.argsort(key, kind="stable")
    pts, ijk, key = pts[order], ijk[order], key[order]
    _, first, cnt = np.unique(key, return_index=True, return_counts=True)
    slot = np.arange(len(key)) - np.repeat(first, cnt)
    ok = slot < max_pts
    summed = np.zeros((len(first), pts.shape[1]), np.float32)
    np.add.at(summed, np.repeat(np.arange(len(first)), cnt)[ok], pts[ok])
    feats = summed / np.minimum(cnt, max_pts)[:, None]
    zyx = ijk[first][:, ::-1].astype(np.int32)
    if len(first) > max_voxels:
        sel = np.random.choice(len(first), max_voxels, replace=False)
        feats, zyx = feats[sel], zyx[sel]
    return feats, zyx


def task_targets(boxes, names):
    H, W = int(GRID[1]) // STRIDE, int(GRID[0]) // STRIDE
    out = []
    for task in TASKS:
        hm = np.zeros((len(task), H, W), np.float32)
        reg, ind, mask = np.zeros((MAX_OBJS, N_REG), np.float32), np.zeros(MAX_OBJS, np.int64), np.zeros(MAX_OBJS, np.float32)
        k = 0
        for b, n in zip(boxes, names):
            if n not in task or k >= MAX_OBJS:
                continue
            fx, fy = (b[0] - PC_RANGE[0]) / VOXEL[0] / STRIDE, (b[1] - PC_RANGE[1]) / VOXEL[1] / STRIDE
            cx, cy = int(fx), int(fy)
            if not (0 <= cx < W and 0 <= cy < H):
                continue
            r = max(2, int(0.25 * np.hypot(b[3], b[4]) / VOXEL[0] / STRIDE))
            yy, xx = np.ogrid[-r:r + 1, -r:r + 1]
            g = np.exp(-(xx * xx + yy * yy) / (2 * ((2 * r + 1) / 6) ** 2))
            x0, x1, y0, y1 = max(cx - r, 0), min(cx + r + 1, W), max(cy - r, 0), min(cy + r + 1, H)
            c = task.index(n)
            hm[c, y0:y1, x0:x1] = np.maximum(hm[c, y0:y1, x0:x1], g[y0 - cy + r:y1 - cy + r, x0 - cx + r:x1 - cx + r])
            reg[k] = [fx - cx, fy - cy, b[2], *np.log(b[3:6]), np.sin(b[6]), np.cos(b[6]), b[7], b[8]]
            ind[k], mask[k] = cy * W + cx, 1
            k += 1
        out.append((hm, reg, ind, mask))
    return out


class NuScenesLidar(Dataset):
    def __init__(self, root, split, training):
        self.root, self.training = root, training
        with open(os.path.join(root, f"nuscenes_infos_10sweeps_{split}.pkl"), "rb") as f:
            self.infos = pickle.load(f)
        if training:
            self.gt_sampler = GTDatabaseSampler(root, os.path.join(root, "nuscenes_dbinfos_10sweeps_withvelo.pkl"),
                                                sample_groups={"car": 2, "truck": 3, "construction_vehicle": 7, "bus": 4,
                                                               "trailer": 6, "barrier": 2, "motorcycle": 6, "bicycle": 6,
                                                               "pedestrian": 2, "traffic_cone": 2})

    def __len__(self):
        return len(self.infos)

    def __getitem__(self, i):
        info = self.infos[i]
        pts = load_sweeps(self.root, info)
        keep = np.isin(info["gt_names"], CLASSES) & (info["num_lidar_pts"] > 0)
        boxes = np.nan_to_num(info["gt_boxes"][keep]).astype(np.float32)
        names = info["gt_names"][keep]
        if self.training:
            pts, boxes, names = self.gt_sampler(pts, boxes, names)
            pts, boxes = random_flip_bev(pts, boxes, with_velocity=True)
            pts, boxes = global_rot_scale(pts, boxes, rot=(-0.785, 0.785), scale=(0.9, 1.1), with_velocity=True)
        pts = pts[np.all((pts[:, :3] >= PC_RANGE[:3]) & (pts[:, :3] < PC_RANGE[3:]), 1)]
        feats, coords = voxelize(pts)
        return {"feats": feats, "coords": coords, "targets": task_targets(boxes, names), "token": info["token"]}


def collate(batch):
    out = {"feats": torch.from_numpy(np.concatenate([b["feats"] for b in batch])),
           "coords": torch.from_numpy(np.concatenate([np.pad(b["coords"], ((0, 0), (1, 0)), constant_values=i)
                                                      for i, b in enumerate(batch)])),
           "tokens": [b["token"] for b in batch], "batch_size": len(batch), "targets": []}
    for t in range(len(TASKS)):
        out["targets"].append([torch.from_numpy(np.stack([b["targets"][t][j] for b in batch])) for j in range(4)])
    return out


def spblock(cin, cout, key, stride=1, pad=1, subm=True, k=3):
    conv = (spconv.SubMConv3d(cin, cout, k, padding=pad, bias=False, indice_key=key) if subm
            else spconv.SparseConv3d(cin, cout, k, stride, pad, bias=False, indice_key=key))
    return spconv.SparseSequential(conv, nn.BatchNorm1d(cout, eps=1e-3, momentum=0.01), nn.ReLU(inplace=True))


def cbr(cin, cout, s=1):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, s, 1, bias=False), nn.BatchNorm2d(cout, eps=1e-3, momentum=0.01), nn.ReLU(inplace=True))


class CenterPoint(nn.Module):
    def __init__(self):
        super().__init__()
        self.sparse_shape = [int(GRID[2]) + 1, int(GRID[1]), int(GRID[0])]
        self.encoder = spconv.SparseSequential(
            spblock(5, 16, "s1"), spblock(16, 16, "s1"),
            spblock(16, 32, "d2", 2, 1, False), spblock(32, 32, "s2"), spblock(32, 32, "s2"),
            spblock(32, 64, "d3", 2, 1, False), spblock(64, 64, "s3"), spblock(64, 64, "s3"),
            spblock(64, 128, "d4", 2, (0, 1, 1), False), spblock(128, 128, "s4"), spblock(128, 128, "s4"),
            spblock(128, 128, "d5", (2, 1, 1), 0, False, (3, 1, 1)))
        self.bev_a = nn.Sequential(cbr(256, 128), *[cbr(128, 128) for _ in range(5)])
        self.bev_b = nn.Sequential(cbr(128, 256, 2), *[cbr(256, 256) for _ in range(5)])
        self.up_a = nn.Sequential(nn.Conv2d(128, 256, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU(inplace=True))
        self.up_b = nn.Sequential(nn.ConvTranspose2d(256, 256, 2, 2, bias=False), nn.BatchNorm2d(256), nn.ReLU(inplace=True))
        self.shared = cbr(512, 64)
        self.heads = nn.ModuleList()
        for task in TASKS:
            head = nn.ModuleDict({"hm": nn.Sequential(cbr(64, 64), nn.Conv2d(64, len(task), 1)),
                                  "reg": nn.Sequential(cbr(64, 64), nn.Conv2d(64, N_REG, 1))})
            nn.init.constant_(head["hm"][-1].bias, -2.19)
            self.heads.append(head)

    def forward(self, feats, coords, batch_size):
        x = self.encoder(spconv.SparseConvTensor(feats, coords.int(), self.sparse_shape, batch_size))
        x = x.dense().flatten(1, 2)
        a = self.bev_a(x)
        x = self.shared(torch.cat([self.up_a(a), self.up_b(self.bev_b(a))], 1))
        return [(h["hm"](x), h["reg"](x)) for h in self.heads]


def center_loss(preds, targets):
    total_hm, total_reg = 0.0, 0.0
    for (hm_logit, reg_map), (hm, reg, ind, mask) in zip(preds, targets):
        p = hm_logit.float().sigmoid().clamp(1e-4, 1 - 1e-4)
        pos = hm.eq(1).float()
        l_hm = -(torch.log(p) * (1 - p) ** 2 * pos + torch.log(1 - p) * p ** 2 * (1 - hm) ** 4 * (1 - pos)).sum()
        total_hm = total_hm + l_hm / pos.sum().clamp(min=1)
        B, C = reg_map.shape[:2]
        pr = reg_map.flatten(2).gather(2, ind.unsqueeze(1).expand(-1, C, -1)).transpose(1, 2)
        m = mask.unsqueeze(-1)
        code_w = reg_map.new_tensor([1, 1, 1, 1, 1, 1, 1, 1, 0.2, 0.2])
        total_reg = total_reg + (F.l1_loss(pr * m, reg * m, reduction="none") * code_w).sum() / mask.sum().clamp(min=1)
    return total_hm, total_reg


@torch.no_grad()
def predict(preds, tokens, K=500, thr=0.1):
    results = {t: [] for t in tokens}
    offset = 0
    for (hm_logit, reg_map), task in zip(preds, TASKS):
        B, C, H, W = hm_logit.shape
        heat = hm_logit.sigmoid()
        heat = heat * (F.max_pool2d(heat, 3, 1, 1) == heat)
        scores, idx = heat.flatten(1).topk(min(K, heat[0].numel()))
        cls, pix = idx // (H * W), idx % (H * W)
        r = reg_map.flatten(2).gather(2, pix.unsqueeze(1).expand(-1, N_REG, -1)).transpose(1, 2)
        x = ((pix % W).float() + r[..., 0]) * STRIDE * float(VOXEL[0]) + float(PC_RANGE[0])
        y = ((pix // W).float() + r[..., 1]) * STRIDE * float(VOXEL[1]) + float(PC_RANGE[1])
        boxes = torch.cat([x[..., None], y[..., None], r[..., 2:3], r[..., 3:6].exp(),
                           torch.atan2(r[..., 6:7], r[..., 7:8]), r[..., 8:10]], -1)
        for b, tok in enumerate(tokens):
            k = scores[b] > thr
            results[tok].append((boxes[b][k].cpu().numpy(), scores[b][k].cpu().numpy(), (cls[b][k] + offset).cpu().numpy()))
        offset += len(task)
    return {t: tuple(np.concatenate(parts) for parts in zip(*v)) for t, v in results.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/nuscenes")
    ap.add_argument("--work_dir", default="work_dirs/centerpoint_voxel_nus")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch_size", type=int, default=2)
    ap.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    np.random.seed(1000 + rank)

    train_set, val_set = NuScenesLidar(args.root, "train", True), NuScenesLidar(args.root, "val", False)
    sampler = DistributedSampler(train_set)
    loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.workers,
                        collate_fn=collate, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, args.batch_size, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=args.workers, collate_fn=collate)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(CenterPoint()).to(dev)
    start_epoch = 0
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.01)
    steps_per_epoch = len(loader) // args.accum
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, total_steps=args.epochs * steps_per_epoch, pct_start=0.4)
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        net.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch = ckpt["epoch"] + 1
    model = DDP(net, device_ids=[local_rank])

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for it, batch in enumerate(loader):
            if it >= steps_per_epoch * args.accum:
                break
            feats, coords = batch["feats"].to(dev, non_blocking=True), batch["coords"].to(dev, non_blocking=True)
            targets = [[t.to(dev, non_blocking=True) for t in task] for task in batch["targets"]]
            last_micro = (it + 1) % args.accum == 0
            if last_micro:
                l_hm, l_reg = center_loss(model(feats, coords, batch["batch_size"]), targets)
                ((l_hm + 0.25 * l_reg) / args.accum).backward()
            else:
                with model.no_sync():
                    l_hm, l_reg = center_loss(model(feats, coords, batch["batch_size"]), targets)
                    ((l_hm + 0.25 * l_reg) / args.accum).backward()
                continue
            # gradients are identical on all ranks after the all-reduce, so every rank takes the same branch
            gnorm = nn.utils.clip_grad_norm_(model.parameters(), 35.0)
            if torch.isfinite(gnorm):
                opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            step = (it + 1) // args.accum
            if step % 50 == 0:
                s = torch.stack([l_hm.detach(), l_reg.detach()])
                dist.all_reduce(s, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"e{epoch} step {step}/{steps_per_epoch} hm {s[0]:.3f} reg {s[1]:.3f} gnorm {gnorm:.1f} "
                          f"{(time.time() - tic) / (it + 1):.2f}s/it", flush=True)

        if rank == 0:
            os.makedirs(args.work_dir, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, os.path.join(args.work_dir, f"epoch_{epoch + 1}.pth"))

        if (epoch + 1) % 5 == 0 or epoch + 1 == args.epochs:
            model.eval()
            dets = {}
            with torch.no_grad():
                for batch in val_loader:
                    preds = model.module(batch["feats"].to(dev), batch["coords"].to(dev), batch["batch_size"])
                    dets.update(predict(preds, batch["tokens"]))
            parts = [None] * world
            dist.all_gather_object(parts, dets)
            if rank == 0:
                merged = {}
                for p in parts:
                    merged.update(p)
                m_ap, per_class = nusc_center_map(merged, val_set.infos, CLASSES)
                print(f"epoch {epoch} val mAP {m_ap:.4f} | " + " ".join(f"{c}:{a:.3f}" for c, a in per_class.items()),
                      flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
