"""SECOND (spconv 2.x sparse backbone + anchor head) on KITTI, DDP training.

    torchrun --nproc_per_node=4 02_second_spconv_dist.py --data_root /data/kitti --batch_size 4
"""
import argparse
import datetime
import os
import pickle

import numpy as np
import spconv.pytorch as spconv
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision.ops import batched_nms, box_iou, sigmoid_focal_loss

from det3d_lite.augment import GTDatabaseSampler, global_flip, global_rotation, global_scaling
from det3d_lite.box_coder import ResidualCoder, limit_period, nearest_bev
from det3d_lite.kitti_eval import kitti_bev_ap

CLASSES = ("Car", "Pedestrian", "Cyclist")
PC_RANGE = np.array([0, -40, -3, 70.4, 40, 1], dtype=np.float32)
VOXEL_SIZE = np.array([0.05, 0.05, 0.1], dtype=np.float32)
GRID = np.round((PC_RANGE[3:] - PC_RANGE[:3]) / VOXEL_SIZE).astype(np.int64)  # 1408, 1600, 40
ANCHORS = [  # size (l, w, h), bottom z, pos / neg iou
    ([3.9, 1.6, 1.56], -1.78, 0.6, 0.45),
    ([0.8, 0.6, 1.73], -0.6, 0.5, 0.35),
    ([1.76, 0.6, 1.73], -0.6, 0.5, 0.35),
]


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


class KittiVoxelDataset(Dataset):
    def __init__(self, root, split, training):
        self.root, self.training = root, training
        with open(os.path.join(root, f"kitti_infos_{split}.pkl"), "rb") as f:
            self.infos = pickle.load(f)
        if training:
            self.db_sampler = GTDatabaseSampler(
                root, os.path.join(root, "kitti_dbinfos_train.pkl"),
                sample_groups={"Car": 15, "Pedestrian": 10, "Cyclist": 10},
                min_points={"Car": 5, "Pedestrian": 5, "Cyclist": 5})

    def __len__(self):
        return len(self.infos)

    def __getitem__(self, idx):
        info = self.infos[idx]
        fid = info["point_cloud"]["lidar_idx"]
        points = np.fromfile(os.path.join(self.root, "training/velodyne", f"{fid}.bin"), np.float32).reshape(-1, 4)
        annos = info["annos"]
        m = np.isin(annos["name"], CLASSES)
        boxes, names = annos["gt_boxes_lidar"][m].astype(np.float32), annos["name"][m]
        if self.training:
            points, boxes, names = self.db_sampler(points, boxes, names)
            points, boxes = global_flip(points, boxes)
            points, boxes = global_rotation(points, boxes, (-np.pi / 4, np.pi / 4))
            points, boxes = global_scaling(points, boxes, (0.95, 1.05))
        points = points[np.all((points[:, :3] >= PC_RANGE[:3]) & (points[:, :3] < PC_RANGE[3:]), 1)]
        keep = np.all((boxes[:, :3] >= PC_RANGE[:3]) & (boxes[:, :3] < PC_RANGE[3:]), 1)
        boxes, names = boxes[keep], names[keep]
        if self.training:
            points = np.random.permutation(points)
        voxels, coords, num = voxelize(points, max_voxels=16000 if self.training else 40000)
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
                num=torch.from_numpy(np.concatenate([b["num"] for b in batch])),
                coords=torch.from_numpy(coords), gt_boxes=torch.from_numpy(gt),
                frame_ids=[b["frame_id"] for b in batch], batch_size=len(batch))


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


def setup():
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=60))
    return dist.get_rank(), dist.get_world_size(), local_rank


def worker_init(worker_id):
    # torch seeds each worker from the rank's base seed, reuse it for numpy augmentation
    seed = torch.initial_seed() % 2 ** 32
    np.random.seed(seed)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_root", default="/data/kitti")
    ap.add_argument("--work_dir", default="work_dirs/second_kitti")
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--lr", type=float, default=0.003)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--resume", default="")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    rank, world, local_rank = setup()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)  # weights are broadcast from rank 0 when DDP wraps the model

    train_set = KittiVoxelDataset(args.data_root, "train", True)
    val_set = KittiVoxelDataset(args.data_root, "val", False)
    train_sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                              collate_fn=collate, worker_init_fn=worker_init, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, args.batch_size, sampler=DistributedSampler(val_set, world, rank, shuffle=False),
                            num_workers=args.workers, collate_fn=collate)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(SECOND()).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.95, 0.99))
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, total_steps=args.epochs * len(train_loader),
                                                    pct_start=0.4, div_factor=10)
    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1
    # SyncBN keeps running stats identical, no need to broadcast buffers each forward
    model = DDP(model, device_ids=[local_rank], broadcast_buffers=False)
    targets = AnchorTargets((int(GRID[1]) // 8, int(GRID[0]) // 8), device)
    tb = SummaryWriter(os.path.join(args.work_dir, "tb")) if rank == 0 else None

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for i, batch in enumerate(train_loader):
            cls, box, dirp = model(batch["voxels"].cuda(non_blocking=True), batch["num"].cuda(non_blocking=True),
                                   batch["coords"].cuda(non_blocking=True), batch["batch_size"])
            parts = targets.loss(cls, box, dirp, batch["gt_boxes"].cuda())
            loss = parts.sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10)
            optimizer.step()
            scheduler.step()
            if i % 50 == 0:
                parts = parts.detach()
                dist.all_reduce(parts, op=dist.ReduceOp.AVG)
                if rank == 0:
                    step = epoch * len(train_loader) + i
                    for name, v in zip(("cls", "box", "dir"), parts.tolist()):
                        tb.add_scalar(f"loss/{name}", v, step)
                    print(f"epoch {epoch} iter {i}/{len(train_loader)} loss {parts.sum():.3f}", flush=True)

        if (epoch + 1) % 5 == 0:
            model.eval()
            dets = {}
            with torch.no_grad():
                for batch in val_loader:
                    out = model(batch["voxels"].cuda(), batch["num"].cuda(), batch["coords"].cuda(), batch["batch_size"])
                    for fid, gt, pred in zip(batch["frame_ids"], batch["gt_boxes"], targets.predict(*out)):
                        dets[fid] = dict(pred, gt=gt[gt[:, 7] > 0].numpy())
            all_dets = [None] * world if rank == 0 else None
            dist.gather_object(dets, all_dets, dst=0)
            if rank == 0:
                merged = {k: v for part in all_dets for k, v in part.items()}
                aps = kitti_bev_ap(merged, num_classes=len(CLASSES))
                print(f"epoch {epoch} val on {len(merged)} frames: " + " ".join(f"{c}={a:.3f}" for c, a in zip(CLASSES, aps)))
                for c, a in zip(CLASSES, aps):
                    tb.add_scalar(f"val/{c}_AP", a, epoch)
                os.makedirs(args.work_dir, exist_ok=True)
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(), "epoch": epoch},
                           os.path.join(args.work_dir, f"epoch_{epoch + 1}.pth"))
            dist.barrier()

    if tb is not None:
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
