#!/usr/bin/env python3
"""PointPillars KITTI training, mixed precision, keeps the best checkpoint by validation mAP.

Usage:
    torchrun --nnodes=1 --nproc_per_node=4 14_pillars_map_eval.py --data-root /mnt/kitti --amp
"""
import argparse
import json
import logging
import os
import pickle
import time
from dataclasses import asdict, dataclass, fields

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.ops import box_iou, batched_nms, sigmoid_focal_loss

from tools.box_utils import decode_residual as decode, encode_residual as encode, limit_period, nearest_bev
from tools.augmentor import GTDatabaseSampler
from tools.eval_utils import bev_center_ap  # center-distance AP, KITTI 40 recall points

CLASSES = ["Car", "Pedestrian", "Cyclist"]
PC_RANGE = np.array([0.0, -39.68, -3.0, 69.12, 39.68, 1.0], dtype=np.float32)
VOXEL_SIZE = np.array([0.16, 0.16, 4.0], dtype=np.float32)
GRID = np.round((PC_RANGE[3:] - PC_RANGE[:3]) / VOXEL_SIZE).astype(np.int64)  # x, y, z
ANCHOR_SIZES = [[3.9, 1.6, 1.56], [0.8, 0.6, 1.73], [1.76, 0.6, 1.73]]
ANCHOR_Z = [-1.78, -0.6, -0.6]
IOU_THR = [(0.6, 0.45), (0.5, 0.35), (0.5, 0.35)]
DIR_OFFSET = 0.78539
SAMPLE_GROUPS = {"Car": 15, "Pedestrian": 10, "Cyclist": 10}

logger = logging.getLogger("pp_train")


# ----------------------------------------------------------------------------- data
def pillarize(points, max_points=32, max_pillars=16000):
    coords = np.floor((points[:, :3] - PC_RANGE[:3]) / VOXEL_SIZE).astype(np.int64)
    key = coords[:, 1] * GRID[0] + coords[:, 0]
    order = np.argsort(key, kind="stable")
    points, coords, key = points[order], coords[order], key[order]
    uniq, first, counts = np.unique(key, return_index=True, return_counts=True)
    slot = np.arange(len(key)) - np.repeat(first, counts)
    pid = np.repeat(np.arange(len(uniq)), counts)
    keep = slot < max_points
    pillars = np.zeros((len(uniq), max_points, points.shape[1]), dtype=np.float32)
    pillars[pid[keep], slot[keep]] = points[keep]
    num = np.minimum(counts, max_points).astype(np.int32)
    yx = coords[first][:, [1, 0]]
    if len(uniq) > max_pillars:
        sel = np.random.permutation(len(uniq))[:max_pillars]
        pillars, num, yx = pillars[sel], num[sel], yx[sel]
    return pillars, yx.astype(np.int32), num


class KittiPillars(Dataset):
    def __init__(self, root, split, training):
        self.root, self.training = root, training
        with open(os.path.join(root, f"kitti_infos_{split}.pkl"), "rb") as f:
            self.infos = pickle.load(f)
        self.sampler = (GTDatabaseSampler(root, os.path.join(root, "kitti_dbinfos_train.pkl"), SAMPLE_GROUPS, min_points=5)
                        if training else None)

    def __len__(self):
        return len(self.infos)

    def __getitem__(self, idx):
        info = self.infos[idx]
        frame_id = info["point_cloud"]["lidar_idx"]
        points = np.fromfile(os.path.join(self.root, "training", "velodyne_reduced", f"{frame_id}.bin"),
                             dtype=np.float32).reshape(-1, 4)
        annos = info["annos"]
        keep = np.isin(annos["name"], CLASSES)
        boxes, names = annos["gt_boxes_lidar"][keep].astype(np.float32), annos["name"][keep]
        if self.training:
            points, boxes, names = self.sampler(points, boxes, names)
            if np.random.rand() < 0.5:
                points[:, 1] *= -1
                boxes[:, 1] *= -1
                boxes[:, 6] *= -1
            rot = np.random.uniform(-np.pi / 4, np.pi / 4)
            c, s = np.cos(rot), np.sin(rot)
            R = np.array([[c, -s], [s, c]], dtype=np.float32)
            points[:, :2] = points[:, :2] @ R.T
            boxes[:, :2] = boxes[:, :2] @ R.T
            boxes[:, 6] += rot
        in_range = np.all((points[:, :3] >= PC_RANGE[:3]) & (points[:, :3] < PC_RANGE[3:]), axis=1)
        points = points[in_range]
        box_keep = np.all((boxes[:, :2] >= PC_RANGE[:2]) & (boxes[:, :2] < PC_RANGE[3:5]), axis=1)
        boxes, names = boxes[box_keep], names[box_keep]
        if self.training:
            np.random.shuffle(points)
        pillars, coords, num = pillarize(points, max_pillars=16000 if self.training else 40000)
        labels = np.array([CLASSES.index(n) + 1 for n in names], dtype=np.float32)
        return {"pillars": pillars, "coords": coords, "num_points": num, "frame_id": frame_id,
                "gt_boxes": np.concatenate([boxes, labels[:, None]], axis=1) if len(boxes) else np.zeros((0, 8), np.float32)}


def collate(batch):
    max_gt = max(max(len(b["gt_boxes"]) for b in batch), 1)
    gt = np.zeros((len(batch), max_gt, 8), dtype=np.float32)
    for i, b in enumerate(batch):
        gt[i, :len(b["gt_boxes"])] = b["gt_boxes"]
    coords = [np.pad(b["coords"], ((0, 0), (1, 0)), constant_values=i) for i, b in enumerate(batch)]
    return {"pillars": torch.from_numpy(np.concatenate([b["pillars"] for b in batch])),
            "coords": torch.from_numpy(np.concatenate(coords)).long(),
            "num_points": torch.from_numpy(np.concatenate([b["num_points"] for b in batch])),
            "gt_boxes": torch.from_numpy(gt), "frame_ids": [b["frame_id"] for b in batch], "batch_size": len(batch)}


# ----------------------------------------------------------------------------- model
class PillarNet(nn.Module):
    def __init__(self, num_anchor_per_loc=6):
        super().__init__()
        self.pfn = nn.Linear(10, 64, bias=False)
        self.pfn_norm = nn.BatchNorm1d(64, eps=1e-3, momentum=0.01)

        def block(cin, cout, n, stride):
            layers = [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout, eps=1e-3, momentum=0.01), nn.ReLU()]
            for _ in range(n):
                layers += [nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout, eps=1e-3, momentum=0.01), nn.ReLU()]
            return nn.Sequential(*layers)

        def deblock(cin, cout, stride):
            up = nn.ConvTranspose2d(cin, cout, stride, stride, bias=False) if stride > 1 else nn.Conv2d(cin, cout, 1, bias=False)
            return nn.Sequential(up, nn.BatchNorm2d(cout, eps=1e-3, momentum=0.01), nn.ReLU())

        self.blocks = nn.ModuleList([block(64, 64, 3, 2), block(64, 128, 5, 2), block(128, 256, 5, 2)])
        self.deblocks = nn.ModuleList([deblock(64, 128, 1), deblock(128, 128, 2), deblock(256, 128, 4)])
        self.conv_cls = nn.Conv2d(384, num_anchor_per_loc * len(CLASSES), 1)
        self.conv_box = nn.Conv2d(384, num_anchor_per_loc * 7, 1)
        self.conv_dir = nn.Conv2d(384, num_anchor_per_loc * 2, 1)
        nn.init.constant_(self.conv_cls.bias, -np.log((1 - 0.01) / 0.01))
        self.register_buffer("voxel_size", torch.from_numpy(VOXEL_SIZE))
        self.register_buffer("pc_min", torch.from_numpy(PC_RANGE[:3]))

    def forward(self, pillars, coords, num_points, batch_size):
        n = num_points.clamp(min=1).view(-1, 1, 1).float()
        mean = pillars[:, :, :3].sum(1, keepdim=True) / n
        centers = coords[:, [3, 2]].float() * self.voxel_size[:2] + self.voxel_size[:2] / 2 + self.pc_min[:2]
        feats = torch.cat([pillars, pillars[:, :, :3] - mean, pillars[:, :, :2] - centers[:, None]], dim=-1)
        mask = torch.arange(pillars.shape[1], device=pillars.device)[None] < num_points[:, None]
        feats = feats * mask.unsqueeze(-1)
        x = self.pfn(feats)
        x = F.relu(self.pfn_norm(x.permute(0, 2, 1)).permute(0, 2, 1)).max(dim=1)[0]

        canvas = x.new_zeros(batch_size, 64, int(GRID[1]) * int(GRID[0]))
        flat = coords[:, 2] * int(GRID[0]) + coords[:, 3]
        canvas[coords[:, 0], :, flat] = x
        x = canvas.view(batch_size, 64, int(GRID[1]), int(GRID[0]))

        ups = []
        for blk, deblk in zip(self.blocks, self.deblocks):
            x = blk(x)
            ups.append(deblk(x))
        x = torch.cat(ups, dim=1)
        B = x.shape[0]
        cls = self.conv_cls(x).permute(0, 2, 3, 1).reshape(B, -1, len(CLASSES))
        box = self.conv_box(x).permute(0, 2, 3, 1).reshape(B, -1, 7)
        dirp = self.conv_dir(x).permute(0, 2, 3, 1).reshape(B, -1, 2)
        return cls, box, dirp


def make_anchors(h, w, device):
    xs = torch.arange(w, device=device, dtype=torch.float32) * (PC_RANGE[3] - PC_RANGE[0]) / w + PC_RANGE[0] + (PC_RANGE[3] - PC_RANGE[0]) / w / 2
    ys = torch.arange(h, device=device, dtype=torch.float32) * (PC_RANGE[4] - PC_RANGE[1]) / h + PC_RANGE[1] + (PC_RANGE[4] - PC_RANGE[1]) / h / 2
    yy, xx = torch.meshgrid(ys, xs, indexing="ij")
    per_loc = []
    for size, z in zip(ANCHOR_SIZES, ANCHOR_Z):
        for rot in (0.0, np.pi / 2):
            vals = [xx, yy, torch.full_like(xx, z)] + [torch.full_like(xx, v) for v in size] + [torch.full_like(xx, rot)]
            per_loc.append(torch.stack(vals, dim=-1))
    anchors = torch.stack(per_loc, dim=2).view(-1, 7)
    anchor_cls = torch.arange(len(CLASSES), device=device).repeat_interleave(2).repeat(h * w)
    return anchors, anchor_cls


def assign(anchors, anchor_cls, anchor_bev, gt):
    valid = gt[:, 7] > 0
    boxes, labels = gt[valid, :7], gt[valid, 7].long() - 1
    cls_t = torch.zeros(len(anchors), dtype=torch.long, device=anchors.device)
    matched = torch.zeros_like(anchors)
    for c, (pos_thr, neg_thr) in enumerate(IOU_THR):
        am, gm = anchor_cls == c, labels == c
        if gm.sum() == 0:
            continue
        idx = am.nonzero(as_tuple=True)[0]
        iou = box_iou(anchor_bev[am], nearest_bev(boxes[gm]))
        max_iou, arg = iou.max(1)
        pos = max_iou >= pos_thr
        best = iou.argmax(0)
        pos[best] = True
        arg[best] = torch.arange(len(best), device=anchors.device)
        cls_t[idx[(max_iou >= neg_thr) & ~pos]] = -1
        cls_t[idx[pos]] = c + 1
        matched[idx[pos]] = boxes[gm][arg[pos]]
    return cls_t, matched


def compute_loss(cls_pred, box_pred, dir_pred, anchors, anchor_cls, gt_boxes):
    anchor_bev = nearest_bev(anchors)
    losses = {"cls": 0.0, "box": 0.0, "dir": 0.0}
    for b in range(cls_pred.shape[0]):
        cls_t, matched = assign(anchors, anchor_cls, anchor_bev, gt_boxes[b])
        pos = cls_t > 0
        npos = pos.sum().clamp(min=1).float()
        cared = cls_t >= 0
        onehot = F.one_hot(cls_t.clamp(min=0), len(CLASSES) + 1)[:, 1:].float()
        losses["cls"] = losses["cls"] + sigmoid_focal_loss(cls_pred[b][cared], onehot[cared], alpha=0.25, gamma=2.0, reduction="sum") / npos
        target = encode(matched[pos], anchors[pos])
        pred = box_pred[b][pos]
        pred_rot = torch.sin(pred[:, 6:7]) * torch.cos(target[:, 6:7])
        tgt_rot = torch.cos(pred[:, 6:7]) * torch.sin(target[:, 6:7])
        losses["box"] = losses["box"] + 2.0 * F.smooth_l1_loss(torch.cat([pred[:, :6], pred_rot], 1), torch.cat([target[:, :6], tgt_rot], 1),
                                                               beta=1.0 / 9.0, reduction="sum") / npos
        dir_t = torch.floor(limit_period(matched[pos, 6] - DIR_OFFSET, 0, 2 * np.pi) / np.pi).long().clamp(0, 1)
        losses["dir"] = losses["dir"] + 0.2 * F.cross_entropy(dir_pred[b][pos], dir_t, reduction="sum") / npos
    return {k: v / cls_pred.shape[0] for k, v in losses.items()}


@torch.no_grad()
def postprocess(cls_pred, box_pred, dir_pred, anchors, score_thr=0.1, max_out=100):
    out = []
    for b in range(cls_pred.shape[0]):
        scores, labels = cls_pred[b].sigmoid().max(-1)
        keep = scores > score_thr
        scores, labels = scores[keep], labels[keep]
        boxes = decode(box_pred[b][keep], anchors[keep])
        dir_lbl = dir_pred[b][keep].argmax(-1)
        boxes[:, 6] = limit_period(boxes[:, 6] - DIR_OFFSET, 0, np.pi) + DIR_OFFSET + np.pi * dir_lbl.float()
        order = scores.argsort(descending=True)[:4096]
        boxes, scores, labels = boxes[order], scores[order], labels[order]
        k = batched_nms(nearest_bev(boxes), scores, labels, 0.1)[:max_out]
        out.append((boxes[k].cpu().numpy(), scores[k].cpu().numpy(), labels[k].cpu().numpy()))
    return out


# ----------------------------------------------------------------------------- main
@dataclass
class TrainConfig:
    data_root: str = "/mnt/kitti"
    work_dir: str = "work_dirs/pp_kitti_3cls"
    epochs: int = 80
    batch_size: int = 6
    lr: float = 3e-3
    weight_decay: float = 0.01
    workers: int = 6
    val_interval: int = 5
    amp: bool = False
    seed: int = 0


def parse_config():
    p = argparse.ArgumentParser()
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type is bool:
            p.add_argument(flag, dest=f.name, action="store_true")
        else:
            p.add_argument(flag, dest=f.name, type=type(f.default), default=f.default)
    return TrainConfig(**vars(p.parse_args()))


@torch.no_grad()
def run_validation(model, loader, anchors, device, amp):
    model.eval()
    results = {}
    for batch in loader:
        with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
            cls, box, dirp = model(batch["pillars"].to(device), batch["coords"].to(device),
                                   batch["num_points"].to(device), batch["batch_size"])
        dets = postprocess(cls.float(), box.float(), dirp.float(), anchors)
        for fid, gt, (bx, sc, lb) in zip(batch["frame_ids"], batch["gt_boxes"], dets):
            results[fid] = {"boxes": bx, "scores": sc, "labels": lb, "gt": gt[gt[:, 7] > 0].numpy()}
    aps = bev_center_ap(results, num_classes=len(CLASSES), dist_thr=2.0)
    model.train()
    return aps


def main():
    cfg = parse_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    np.random.seed(cfg.seed + rank)
    torch.manual_seed(cfg.seed)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format=f"[rank{rank}] %(asctime)s %(levelname)s %(message)s")
    if rank == 0:
        os.makedirs(cfg.work_dir, exist_ok=True)
        with open(os.path.join(cfg.work_dir, "config.json"), "w") as f:
            json.dump(asdict(cfg), f, indent=2)

    train_set = KittiPillars(cfg.data_root, "train", training=True)
    val_set = KittiPillars(cfg.data_root, "val", training=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=cfg.seed)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=train_sampler, num_workers=cfg.workers,
                              collate_fn=collate, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=cfg.batch_size, sampler=val_sampler, num_workers=cfg.workers,
                            collate_fn=collate, pin_memory=True)
    logger.info("train frames %d, val frames %d, world size %d", len(train_set), len(val_set), world_size)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(PillarNet()).to(device)
    model = DDP(model, device_ids=[local_rank])
    anchors, anchor_cls = make_anchors(int(GRID[1]) // 2, int(GRID[0]) // 2, device)

    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=cfg.lr, total_steps=cfg.epochs * len(train_loader),
                                                    pct_start=0.4, div_factor=10)
    scaler = torch.cuda.amp.GradScaler(enabled=cfg.amp)
    best_map = -1.0

    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, running = time.time(), torch.zeros(4, device=device)
        for it, batch in enumerate(train_loader):
            with torch.autocast("cuda", dtype=torch.float16, enabled=cfg.amp):
                cls, box, dirp = model(batch["pillars"].to(device, non_blocking=True),
                                       batch["coords"].to(device, non_blocking=True),
                                       batch["num_points"].to(device, non_blocking=True), batch["batch_size"])
            losses = compute_loss(cls.float(), box.float(), dirp.float(), anchors, anchor_cls, batch["gt_boxes"].to(device))
            loss = sum(losses.values())
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            running += torch.stack([loss.detach()] + [v.detach() for v in losses.values()])
            if (it + 1) % 50 == 0:
                dist.all_reduce(running)
                running /= world_size * 50
                logger.info("ep %d it %d/%d loss %.4f (cls %.4f box %.4f dir %.4f) lr %.2e", epoch, it + 1,
                            len(train_loader), *running.tolist(), scheduler.get_last_lr()[0])
                running.zero_()
        logger.info("epoch %d took %.1f min", epoch, (time.time() - t0) / 60)

        if (epoch + 1) % cfg.val_interval == 0 or epoch + 1 == cfg.epochs:
            aps = run_validation(model, val_loader, anchors, device, cfg.amp)
            mean_ap = float(np.nanmean(aps))
            if rank == 0:
                logger.info("epoch %d val AP %s mAP %.4f", epoch, dict(zip(CLASSES, np.round(aps, 4))), mean_ap)
                state = {"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                         "scaler": scaler.state_dict(), "mAP": mean_ap}
                torch.save(state, os.path.join(cfg.work_dir, "latest.pth"))
                if mean_ap > best_map:
                    best_map = mean_ap
                    torch.save(state, os.path.join(cfg.work_dir, "best.pth"))
                    logger.info("new best mAP %.4f at epoch %d", best_map, epoch)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
