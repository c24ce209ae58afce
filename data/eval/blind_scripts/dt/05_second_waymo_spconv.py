#!/usr/bin/env python3
"""SECOND (sparse conv) on Waymo Open (vehicle / pedestrian / cyclist), 20% train split.

Usage:
  torchrun --nproc_per_node=8 train_second_waymo.py --data data/waymo/processed --out runs/second_wod_20pct
"""
import argparse
import logging
import os
import pickle

import numpy as np
import spconv.pytorch as spconv
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

from av3d.anchor import AnchorGenerator3D, DeltaXYZWLHRBBoxCoder, assign_anchor_targets
from av3d.ops import points_to_voxels, nms_bev_batched
from av3d.eval.waymo import waymo_let_metrics

CLASSES = ["Vehicle", "Pedestrian", "Cyclist"]
PCR = np.array([-75.2, -75.2, -2.0, 75.2, 75.2, 4.0], dtype=np.float32)
VOXEL = np.array([0.1, 0.1, 0.15], dtype=np.float32)
GRID = ((PCR[3:] - PCR[:3]) / VOXEL).round().astype(int)
SPATIAL = [int(GRID[2]) + 1, int(GRID[1]), int(GRID[0])]  # z, y, x (+1 in z as in OpenPCDet)

log = logging.getLogger("second")


class WaymoFrames(Dataset):
    def __init__(self, root, split, interval=1, training=False):
        with open(os.path.join(root, f"waymo_infos_{split}.pkl"), "rb") as f:
            infos = pickle.load(f)
        self.infos = infos[::interval]
        self.root = root
        self.training = training

    def __len__(self):
        return len(self.infos)

    def __getitem__(self, i):
        info = self.infos[i]
        pts = np.load(os.path.join(self.root, info["lidar_path"]))[:, :5]  # x y z intensity elongation
        pts[:, 3] = np.tanh(pts[:, 3])
        ann = info["annos"]
        keep = np.isin(ann["name"], CLASSES) & (ann["num_points_in_gt"] > 0)
        boxes = ann["gt_boxes_lidar"][keep][:, :7].astype(np.float32)
        labels = np.array([CLASSES.index(n) for n in ann["name"][keep]], np.int64)
        if self.training:
            if np.random.rand() < 0.5:
                pts[:, 1] = -pts[:, 1]
                boxes[:, 1] = -boxes[:, 1]
                boxes[:, 6] = -boxes[:, 6]
            if np.random.rand() < 0.5:
                pts[:, 0] = -pts[:, 0]
                boxes[:, 0] = -boxes[:, 0]
                boxes[:, 6] = np.pi - boxes[:, 6]
            a = np.random.uniform(-np.pi / 4, np.pi / 4)
            rot = np.array([[np.cos(a), -np.sin(a)], [np.sin(a), np.cos(a)]], np.float32)
            pts[:, :2] = pts[:, :2] @ rot.T
            boxes[:, :2] = boxes[:, :2] @ rot.T
            boxes[:, 6] += a
        m = np.all((pts[:, :3] >= PCR[:3]) & (pts[:, :3] < PCR[3:]), axis=1)
        return {"points": pts[m], "boxes": boxes, "labels": labels, "index": i}


def collate_voxels(batch):
    voxels, coords, npts = [], [], []
    for b, s in enumerate(batch):
        v, c, n = points_to_voxels(s["points"], VOXEL, PCR, max_points=5, max_voxels=150000)
        voxels.append(torch.from_numpy(v))
        coords.append(F.pad(torch.from_numpy(c), (1, 0), value=b))
        npts.append(torch.from_numpy(n))
    return {
        "voxels": torch.cat(voxels), "coords": torch.cat(coords).int(), "num_points": torch.cat(npts),
        "boxes": [torch.from_numpy(s["boxes"]) for s in batch],
        "labels": [torch.from_numpy(s["labels"]) for s in batch],
        "index": torch.tensor([s["index"] for s in batch]),
    }


def subm(cin, cout, key):
    return spconv.SparseSequential(spconv.SubMConv3d(cin, cout, 3, padding=1, bias=False, indice_key=key),
                                   nn.BatchNorm1d(cout, eps=1e-3, momentum=0.01), nn.ReLU())


def down(cin, cout, key, stride=2, padding=1, kernel=3):
    return spconv.SparseSequential(spconv.SparseConv3d(cin, cout, kernel, stride=stride, padding=padding, bias=False,
                                                       indice_key=key),
                                   nn.BatchNorm1d(cout, eps=1e-3, momentum=0.01), nn.ReLU())


class SECOND(nn.Module):
    def __init__(self, num_anchor_per_loc=6):
        super().__init__()
        self.middle = spconv.SparseSequential(
            subm(5, 16, "s1"), subm(16, 16, "s1"),
            down(16, 32, "d2"), subm(32, 32, "s2"), subm(32, 32, "s2"),
            down(32, 64, "d3"), subm(64, 64, "s3"), subm(64, 64, "s3"),
            down(64, 64, "d4", padding=(0, 1, 1)), subm(64, 64, "s4"), subm(64, 64, "s4"),
            down(64, 128, "out", stride=(2, 1, 1), padding=0, kernel=(3, 1, 1)),
        )
        c = 128 * 2
        self.bev = nn.Sequential(*[m for cin, cout in [(c, 128), (128, 128), (128, 128)]
                                   for m in (nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                                             nn.BatchNorm2d(cout, eps=1e-3, momentum=0.01), nn.ReLU())])
        self.cls = nn.Conv2d(128, num_anchor_per_loc * len(CLASSES), 1)
        self.reg = nn.Conv2d(128, num_anchor_per_loc * 7, 1)
        self.dir = nn.Conv2d(128, num_anchor_per_loc * 2, 1)

    def forward(self, voxels, coords, num_points, batch_size):
        feats = voxels[:, :, :5].sum(1) / num_points.clamp(min=1).unsqueeze(1).type_as(voxels)
        x = spconv.SparseConvTensor(feats, coords, SPATIAL, batch_size)
        x = self.middle(x).dense()
        N, C, D, H, W = x.shape
        x = self.bev(x.view(N, C * D, H, W))
        return self.cls(x), self.reg(x), self.dir(x)


def anchor_loss(preds, tgt):
    cls, reg, dirc = [p.permute(0, 2, 3, 1).flatten(1, 2) for p in preds]
    B = cls.shape[0]
    cls, reg, dirc = cls.reshape(B, -1, len(CLASSES)), reg.reshape(B, -1, 7), dirc.reshape(B, -1, 2)
    labels, reg_t, dir_t, w = tgt
    pos = labels >= 0
    npos = pos.sum().float().clamp(min=1.0)
    onehot = F.one_hot(labels.clamp(min=0), len(CLASSES)).float() * pos[..., None]
    l_cls = torchvision_focal(cls, onehot, w) / npos
    l_reg = F.smooth_l1_loss(reg[pos], reg_t[pos], beta=1 / 9, reduction="sum") / npos
    l_dir = F.cross_entropy(dirc[pos], dir_t[pos], reduction="sum") / npos
    return l_cls + 2 * l_reg + 0.2 * l_dir


def torchvision_focal(logits, onehot, w, alpha=0.25, gamma=2.0):
    p = logits.sigmoid()
    ce = F.binary_cross_entropy_with_logits(logits, onehot, reduction="none")
    p_t = p * onehot + (1 - p) * (1 - onehot)
    a_t = alpha * onehot + (1 - alpha) * (1 - onehot)
    return (a_t * ce * (1 - p_t) ** gamma * w[..., None]).sum()


@torch.no_grad()
def evaluate(model, loader, anchors, coder, dataset, device):
    model.eval()
    rows = []
    for batch in loader:
        cls, reg, _ = model(batch["voxels"].to(device), batch["coords"].to(device),
                            batch["num_points"].to(device), len(batch["index"]))
        B = cls.shape[0]
        scores = cls.permute(0, 2, 3, 1).reshape(B, -1, len(CLASSES)).sigmoid()
        boxes = coder.decode(anchors[None].expand(B, -1, -1), reg.permute(0, 2, 3, 1).reshape(B, -1, 7))
        for b, (bx, sc, lab) in enumerate(nms_bev_batched(boxes, scores, score_thr=0.1, iou_thr=0.7, max_num=500)):
            idx = torch.full((len(bx), 1), float(batch["index"][b]), device=device)
            rows.append(torch.cat([idx, bx, sc[:, None], lab[:, None].float()], 1))
    local = torch.cat(rows) if rows else torch.zeros((0, 10), device=device)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    model.train()
    if dist.get_rank() != 0:
        return None
    dets = torch.cat(gathered).cpu().numpy()
    per_frame = {}
    for row in dets:
        per_frame.setdefault(int(row[0]), []).append(row[1:])
    per_frame = {k: np.stack(v) for k, v in per_frame.items()}
    return waymo_let_metrics(per_frame, dataset.infos, CLASSES)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/waymo/processed")
    ap.add_argument("--out", default="runs/second_wod")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--train-interval", type=int, default=5, help="use every N-th frame (5 -> 20%%)")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device(f"cuda:{local_rank}")
    is_main = dist.get_rank() == 0
    logging.basicConfig(level=logging.INFO if is_main else logging.WARN, format="[%(asctime)s] %(message)s")

    train_ds = WaymoFrames(args.data, "train", interval=args.train_interval, training=True)
    val_ds = WaymoFrames(args.data, "val", interval=1)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=8,
                          collate_fn=collate_voxels, pin_memory=True, drop_last=True, persistent_workers=True)
    val_shard = Subset(val_ds, range(dist.get_rank(), len(val_ds), dist.get_world_size()))
    val_dl = DataLoader(val_shard, batch_size=args.bs, shuffle=False, num_workers=8,
                        collate_fn=collate_voxels, pin_memory=True)

    model = SECOND()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank])

    anchors = AnchorGenerator3D(PCR.tolist(), sizes=[[4.7, 2.1, 1.7], [0.91, 0.86, 1.73], [1.78, 0.84, 1.78]],
                                rotations=[0, np.pi / 2], feature_size=(188, 188)).anchors().to(device)
    coder = DeltaXYZWLHRBBoxCoder()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.95, 0.99), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(train_dl),
                                                pct_start=0.4, div_factor=10)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for it, batch in enumerate(train_dl):
            preds = model(batch["voxels"].to(device, non_blocking=True), batch["coords"].to(device, non_blocking=True),
                          batch["num_points"].to(device, non_blocking=True), len(batch["index"]))
            tgt = assign_anchor_targets(anchors, [b.to(device) for b in batch["boxes"]],
                                        [l.to(device) for l in batch["labels"]], coder,
                                        pos_iou=[0.55, 0.5, 0.5], neg_iou=[0.4, 0.35, 0.35])
            loss = anchor_loss(preds, tgt)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10)
            opt.step()
            sched.step()
            if is_main and it % 100 == 0:
                log.info("ep %d it %d/%d loss %.4f lr %.2e", epoch, it, len(train_dl), loss.item(), sched.get_last_lr()[0])
        if is_main:
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(args.out, "latest.pth"))
        if (epoch + 1) % 5 == 0 or epoch + 1 == args.epochs:
            metrics = evaluate(model, val_dl, anchors, coder, val_ds, device)
            if is_main:
                log.info("epoch %d: %s", epoch + 1, " ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
