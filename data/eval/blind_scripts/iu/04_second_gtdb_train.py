"""SECOND on KITTI with on-the-fly ground-truth database creation (first run builds it, later runs reuse it).

    torchrun --nproc_per_node=4 04_second_gtdb_train.py --data_root /data/kitti --work_dir runs/second_gtdb
"""
import argparse
import datetime
import os
import pickle
import time
from collections import defaultdict

import numpy as np
import spconv.pytorch as spconv
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchvision.ops import batched_nms, box_iou, sigmoid_focal_loss

from det3d_lite.box_coder import ResidualCoder, limit_period, nearest_bev
from det3d_lite.kitti_eval import kitti_bev_ap

CLASSES = ("Car", "Pedestrian", "Cyclist")
PC_RANGE = np.array([0, -40, -3, 70.4, 40, 1], dtype=np.float32)
VOXEL_SIZE = np.array([0.05, 0.05, 0.1], dtype=np.float32)
GRID = np.round((PC_RANGE[3:] - PC_RANGE[:3]) / VOXEL_SIZE).astype(np.int64)
ANCHORS = [  # size (l, w, h), bottom z, pos / neg iou
    ([3.9, 1.6, 1.56], -1.78, 0.6, 0.45),
    ([0.8, 0.6, 1.73], -0.6, 0.5, 0.35),
    ([1.76, 0.6, 1.73], -0.6, 0.5, 0.35),
]
SAMPLE_GROUPS = {"Car": 15, "Pedestrian": 10, "Cyclist": 10}


def read_lidar(root, fid):
    return np.fromfile(os.path.join(root, "training", "velodyne", f"{fid}.bin"), np.float32).reshape(-1, 4)


def points_in_boxes(points, boxes):
    d = points[:, None, :3] - boxes[None, :, :3]
    c, s = np.cos(boxes[:, 6]), np.sin(boxes[:, 6])
    lx, ly = d[..., 0] * c + d[..., 1] * s, -d[..., 0] * s + d[..., 1] * c
    return (np.abs(lx) <= boxes[:, 3] / 2) & (np.abs(ly) <= boxes[:, 4] / 2) & (np.abs(d[..., 2]) <= boxes[:, 5] / 2)


def create_gt_database(root, infos, db_dir, info_path):
    """Crop the points of every labelled object (object frame) and index them by class."""
    os.makedirs(db_dir, exist_ok=True)
    db = defaultdict(list)
    for info in infos:
        fid = info["point_cloud"]["lidar_idx"]
        annos = info["annos"]
        n_obj = (annos["name"] != "DontCare").sum()
        boxes, names = annos["gt_boxes_lidar"][:n_obj], annos["name"][:n_obj]
        points = read_lidar(root, fid)
        inside = points_in_boxes(points, boxes)
        for j, name in enumerate(names):
            obj = points[inside[:, j]].copy()
            obj[:, :3] -= boxes[j, :3]
            rel = os.path.join(os.path.basename(db_dir), f"{fid}_{name}_{j}.bin")
            obj.tofile(os.path.join(root, rel))
            db[name].append({"name": name, "path": rel, "box3d_lidar": boxes[j], "num_points_in_gt": len(obj),
                             "difficulty": annos["difficulty"][j], "image_idx": fid})
    with open(info_path, "wb") as f:
        pickle.dump(dict(db), f)


class GTSampler:
    def __init__(self, root, info_path, min_points=5):
        self.root = root
        with open(info_path, "rb") as f:
            db = pickle.load(f)
        self.pools = {c: [d for d in db.get(c, []) if d["num_points_in_gt"] >= min_points and d["difficulty"] >= 0]
                      for c in SAMPLE_GROUPS}

    def __call__(self, points, boxes, names):
        added_boxes, added_pts, added_names = [], [], []
        for cls, target in SAMPLE_GROUPS.items():
            pool, need = self.pools[cls], target - int((names == cls).sum())
            if need <= 0 or not pool:
                continue
            for i in np.random.choice(len(pool), min(need, len(pool)), replace=False):
                box = pool[i]["box3d_lidar"].astype(np.float32)
                others = np.concatenate([boxes] + [b[None] for b in added_boxes]) if len(boxes) or added_boxes else np.zeros((0, 7))
                if len(others) and np.min(np.hypot(others[:, 0] - box[0], others[:, 1] - box[1])
                                          - (np.hypot(others[:, 3], others[:, 4]) + np.hypot(box[3], box[4])) / 2) < 0:
                    continue
                obj = np.fromfile(os.path.join(self.root, pool[i]["path"]), np.float32).reshape(-1, 4)
                obj[:, :3] += box[:3]
                added_boxes.append(box)
                added_pts.append(obj)
                added_names.append(cls)
        if not added_boxes:
            return points, boxes, names
        new_boxes = np.stack(added_boxes)
        points = points[~points_in_boxes(points, new_boxes).any(1)]
        return (np.concatenate(added_pts + [points]), np.concatenate([boxes, new_boxes]),
                np.concatenate([names, np.array(added_names)]))


def voxelize(points, max_points=5, max_voxels=16000):
    ijk = np.floor((points[:, :3] - PC_RANGE[:3]) / VOXEL_SIZE).astype(np.int64)
    key = (ijk[:, 2] * GRID[1] + ijk[:, 1]) * GRID[0] + ijk[:, 0]
    order = np.argsort(key, kind="stable")
    points, ijk, key = points[order], ijk[order], key[order]
    _, first, counts = np.unique(key, return_index=True, return_counts=True)
    slot = np.arange(len(key)) - np.repeat(first, counts)
    vid = np.repeat(np.arange(len(first)), counts)
    ok = slot < max_points
    voxels = np.zeros((len(first), max_points, points.shape[1]), np.float32)
    voxels[vid[ok], slot[ok]] = points[ok]
    num = np.minimum(counts, max_points).astype(np.int32)
    zyx = ijk[first][:, ::-1].astype(np.int32)
    if len(first) > max_voxels:
        sel = np.random.choice(len(first), max_voxels, replace=False)
        voxels, num, zyx = voxels[sel], num[sel], zyx[sel]
    return voxels, zyx, num


class KittiDataset(Dataset):
    def __init__(self, root, infos, training, sampler=None):
        self.root, self.infos, self.training, self.gt_sampler = root, infos, training, sampler

    def __len__(self):
        return len(self.infos)

    def __getitem__(self, idx):
        info = self.infos[idx]
        fid = info["point_cloud"]["lidar_idx"]
        points = read_lidar(self.root, fid)
        m = np.isin(info["annos"]["name"], CLASSES)
        boxes, names = info["annos"]["gt_boxes_lidar"][m].astype(np.float32), info["annos"]["name"][m]
        if self.training:
            points, boxes, names = self.gt_sampler(points, boxes, names)
            if np.random.rand() < 0.5:
                points[:, 1], boxes[:, 1], boxes[:, 6] = -points[:, 1], -boxes[:, 1], -boxes[:, 6]
            a = np.random.uniform(-np.pi / 4, np.pi / 4)
            R = np.array([[np.cos(a), -np.sin(a)], [np.sin(a), np.cos(a)]], np.float32)
            points[:, :2], boxes[:, :2], boxes[:, 6] = points[:, :2] @ R.T, boxes[:, :2] @ R.T, boxes[:, 6] + a
        points = points[np.all((points[:, :3] >= PC_RANGE[:3]) & (points[:, :3] < PC_RANGE[3:]), 1)]
        keep = np.all((boxes[:, :3] >= PC_RANGE[:3]) & (boxes[:, :3] < PC_RANGE[3:]), 1)
        boxes, names = boxes[keep], names[keep]
        voxels, coords, num = voxelize(np.random.permutation(points) if self.training else points,
                                       max_voxels=16000 if self.training else 40000)
        labels = np.array([CLASSES.index(n) + 1 for n in names], np.float32).reshape(-1, 1)
        return dict(voxels=voxels, coords=coords, num=num, frame_id=fid,
                    gt_boxes=np.concatenate([boxes.reshape(-1, 7), labels], 1))


def collate(batch):
    n_gt = max(1, max(len(b["gt_boxes"]) for b in batch))
    gt = np.zeros((len(batch), n_gt, 8), np.float32)
    for i, b in enumerate(batch):
        gt[i, :len(b["gt_boxes"])] = b["gt_boxes"]
    coords = np.concatenate([np.pad(b["coords"], ((0, 0), (1, 0)), constant_values=i) for i, b in enumerate(batch)])
    return dict(voxels=torch.from_numpy(np.concatenate([b["voxels"] for b in batch])),
                num=torch.from_numpy(np.concatenate([b["num"] for b in batch])), coords=torch.from_numpy(coords),
                gt_boxes=torch.from_numpy(gt), frame_ids=[b["frame_id"] for b in batch], batch_size=len(batch))


def sparse_block(cin, cout, key, stride=1, padding=1, kind="subm", kernel=3):
    if kind == "subm":
        conv = spconv.SubMConv3d(cin, cout, kernel, padding=padding, bias=False, indice_key=key)
    else:
        conv = spconv.SparseConv3d(cin, cout, kernel, stride=stride, padding=padding, bias=False, indice_key=key)
    return spconv.SparseSequential(conv, nn.BatchNorm1d(cout, eps=1e-3, momentum=0.01), nn.ReLU())


class SECOND(nn.Module):
    def __init__(self):
        super().__init__()
        self.sparse_shape = [int(GRID[2]) + 1, int(GRID[1]), int(GRID[0])]
        self.encoder = spconv.SparseSequential(
            sparse_block(4, 16, "subm1"), sparse_block(16, 16, "subm1"),
            sparse_block(16, 32, "spconv2", 2, 1, "spconv"), sparse_block(32, 32, "subm2"), sparse_block(32, 32, "subm2"),
            sparse_block(32, 64, "spconv3", 2, 1, "spconv"), sparse_block(64, 64, "subm3"), sparse_block(64, 64, "subm3"),
            sparse_block(64, 64, "spconv4", 2, (0, 1, 1), "spconv"), sparse_block(64, 64, "subm4"), sparse_block(64, 64, "subm4"),
            sparse_block(64, 128, "spconv_down2", (2, 1, 1), 0, "spconv", kernel=(3, 1, 1)),
        )

        def conv(cin, cout, stride=1):
            return [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout, eps=1e-3, momentum=0.01), nn.ReLU()]

        self.block1 = nn.Sequential(*conv(256, 128), *sum([conv(128, 128) for _ in range(5)], []))
        self.block2 = nn.Sequential(*conv(128, 256, 2), *sum([conv(256, 256) for _ in range(5)], []))
        self.deconv1 = nn.Sequential(nn.Conv2d(128, 256, 1, bias=False), nn.BatchNorm2d(256, eps=1e-3, momentum=0.01), nn.ReLU())
        self.deconv2 = nn.Sequential(nn.ConvTranspose2d(256, 256, 2, 2, bias=False), nn.BatchNorm2d(256, eps=1e-3, momentum=0.01), nn.ReLU())
        na = 2 * len(ANCHORS)
        self.conv_cls = nn.Conv2d(512, na * len(CLASSES), 1)
        self.conv_box = nn.Conv2d(512, na * 7, 1)
        self.conv_dir = nn.Conv2d(512, na * 2, 1)
        nn.init.constant_(self.conv_cls.bias, -4.595)

    def forward(self, voxels, num, coords, batch_size):
        feats = voxels.sum(1) / num.clamp(min=1).unsqueeze(1).type_as(voxels)
        x = spconv.SparseConvTensor(feats, coords.int(), self.sparse_shape, batch_size)
        x = self.encoder(x).dense()
        x = x.flatten(1, 2)  # (B, 128 * 2, 200, 176)
        x1 = self.block1(x)
        x2 = self.block2(x1)
        x = torch.cat([self.deconv1(x1), self.deconv2(x2)], 1)
        B = x.shape[0]
        return (self.conv_cls(x).permute(0, 2, 3, 1).reshape(B, -1, len(CLASSES)),
                self.conv_box(x).permute(0, 2, 3, 1).reshape(B, -1, 7),
                self.conv_dir(x).permute(0, 2, 3, 1).reshape(B, -1, 2))


class AnchorTargets:
    def __init__(self, feat_hw, device):
        h, w = feat_hw
        xs = (torch.arange(w, device=device) + 0.5) * (PC_RANGE[3] - PC_RANGE[0]) / w + PC_RANGE[0]
        ys = (torch.arange(h, device=device) + 0.5) * (PC_RANGE[4] - PC_RANGE[1]) / h + PC_RANGE[1]
        yy, xx = torch.meshgrid(ys, xs, indexing="ij")
        per_loc = []
        for size, z, _, _ in ANCHORS:
            for rot in (0.0, np.pi / 2):
                per_loc.append(torch.stack([xx, yy, torch.full_like(xx, z + size[2] / 2)] +
                                           [torch.full_like(xx, s) for s in size] + [torch.full_like(xx, rot)], -1))
        self.anchors = torch.stack(per_loc, 2).view(-1, 7)
        self.anchor_cls = torch.arange(len(ANCHORS), device=device).repeat_interleave(2).repeat(h * w)
        self.anchor_bev = nearest_bev(self.anchors)
        self.coder = ResidualCoder()

    def assign(self, gt):
        gt = gt[gt[:, 7] > 0]
        labels = torch.zeros(len(self.anchors), dtype=torch.long, device=gt.device)
        matched = torch.zeros_like(self.anchors)
        for c, (_, _, pos_thr, neg_thr) in enumerate(ANCHORS):
            am, g = self.anchor_cls == c, gt[gt[:, 7] == c + 1, :7]
            if len(g) == 0:
                continue
            idx = am.nonzero(as_tuple=True)[0]
            iou = box_iou(self.anchor_bev[am], nearest_bev(g))
            best_iou, arg = iou.max(1)
            pos = best_iou >= pos_thr
            force = iou.argmax(0)
            pos[force], arg[force] = True, torch.arange(len(g), device=gt.device)
            labels[idx[(best_iou >= neg_thr) & ~pos]] = -1
            labels[idx[pos]] = c + 1
            matched[idx[pos]] = g[arg[pos]]
        return labels, matched

    def loss(self, cls, box, dirp, gt_boxes):
        total = cls.new_zeros(3)
        for b in range(cls.shape[0]):
            labels, matched = self.assign(gt_boxes[b])
            pos, cared = labels > 0, labels >= 0
            npos = pos.sum().clamp(min=1)
            tgt = F.one_hot(labels.clamp(min=0), len(CLASSES) + 1)[:, 1:].float()
            l_cls = sigmoid_focal_loss(cls[b][cared], tgt[cared], reduction="sum") / npos
            t = self.coder.encode(matched[pos], self.anchors[pos])
            p = box[b][pos]
            p = torch.cat([p[:, :6], torch.sin(p[:, 6:]) * torch.cos(t[:, 6:])], 1)
            t = torch.cat([t[:, :6], torch.cos(box[b][pos][:, 6:]) * torch.sin(t[:, 6:])], 1)
            l_box = F.smooth_l1_loss(p, t, beta=1 / 9, reduction="sum") / npos
            dir_t = (limit_period(matched[pos, 6] - 0.78539, 0, 2 * np.pi) / np.pi).floor().long().clamp(0, 1)
            l_dir = F.cross_entropy(dirp[b][pos], dir_t, reduction="sum") / npos
            total = total + torch.stack([l_cls, 2.0 * l_box, 0.2 * l_dir])
        return total / cls.shape[0]

    @torch.no_grad()
    def predict(self, cls, box, dirp, thr=0.1):
        outs = []
        for b in range(cls.shape[0]):
            scores, labels = cls[b].sigmoid().max(-1)
            k = scores > thr
            boxes = self.coder.decode(box[b][k], self.anchors[k])
            boxes[:, 6] = limit_period(boxes[:, 6] - 0.78539, 0, np.pi) + 0.78539 + np.pi * dirp[b][k].argmax(-1)
            keep = batched_nms(nearest_bev(boxes), scores[k], labels[k], 0.1)[:100]
            outs.append({"boxes": boxes[keep].cpu().numpy(), "scores": scores[k][keep].cpu().numpy(),
                         "labels": labels[k][keep].cpu().numpy()})
        return outs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_root", default="/data/kitti")
    ap.add_argument("--work_dir", default="runs/second_gtdb")
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--lr", type=float, default=0.003)
    ap.add_argument("--workers", type=int, default=4)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=1))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    np.random.seed(2024 + rank)

    with open(os.path.join(args.data_root, "kitti_infos_train.pkl"), "rb") as f:
        train_infos = pickle.load(f)
    with open(os.path.join(args.data_root, "kitti_infos_val.pkl"), "rb") as f:
        val_infos = pickle.load(f)
    db_info_path = os.path.join(args.data_root, "kitti_dbinfos_train.pkl")
    if not os.path.exists(db_info_path):
        print(f"[rank {rank}] building GT database ...", flush=True)
        create_gt_database(args.data_root, train_infos, os.path.join(args.data_root, "gt_database"), db_info_path)

    train_set = KittiDataset(args.data_root, train_infos, True, GTSampler(args.data_root, db_info_path))
    val_set = KittiDataset(args.data_root, val_infos, False)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.workers, collate_fn=collate,
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, args.batch_size, shuffle=False, num_workers=args.workers, collate_fn=collate)

    model = DDP(nn.SyncBatchNorm.convert_sync_batchnorm(SECOND()).to(device), device_ids=[local_rank])
    targets = AnchorTargets((int(GRID[1]) // 8, int(GRID[0]) // 8), device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, total_steps=args.epochs * len(loader), pct_start=0.4)
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for i, batch in enumerate(loader):
            out = model(batch["voxels"].to(device, non_blocking=True), batch["num"].to(device, non_blocking=True),
                        batch["coords"].to(device, non_blocking=True), batch["batch_size"])
            parts = targets.loss(*out, batch["gt_boxes"].to(device))
            optimizer.zero_grad(set_to_none=True)
            parts.sum().backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10)
            optimizer.step()
            scheduler.step()
            if i % 50 == 0:
                parts = parts.detach()
                dist.all_reduce(parts)
                parts /= world
                if rank == 0:
                    print(f"ep {epoch} {i}/{len(loader)} cls {parts[0]:.3f} box {parts[1]:.3f} dir {parts[2]:.3f} "
                          f"{(time.time() - tic) / (i + 1):.2f}s/it", flush=True)

        if rank == 0:
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(args.work_dir, "latest.pth"))
            if (epoch + 1) % 10 == 0:
                # rank 0 evaluates the whole val split while the other ranks wait at the barrier
                net = model.module.eval()
                dets = {}
                with torch.no_grad():
                    for batch in val_loader:
                        out = net(batch["voxels"].to(device), batch["num"].to(device), batch["coords"].to(device),
                                  batch["batch_size"])
                        for fid, gt, pred in zip(batch["frame_ids"], batch["gt_boxes"], targets.predict(*out)):
                            dets[fid] = dict(pred, gt=gt[gt[:, 7] > 0].numpy())
                net.train()
                aps = kitti_bev_ap(dets, num_classes=len(CLASSES))
                print(f"epoch {epoch} " + " ".join(f"{c}={a:.4f}" for c, a in zip(CLASSES, aps)), flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
