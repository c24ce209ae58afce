"""Train CenterPoint (PointPillars encoder) on nuScenes with 10-sweep lidar.

    torchrun --nproc_per_node=8 tools/train_cp_pillar.py \
        --data-root data/nuscenes --work-dir work_dirs/cp_pillar_02 \
        --resume work_dirs/cp_pillar_02/latest.pth
"""
import argparse
import json
import logging
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from mmcv.ops import Voxelization

from av3d.targets import CenterTargetAssigner
from av3d.postprocess import decode_center_heatmap
from av3d.eval import nuscenes_evaluate

CLASS_NAMES = ["car", "truck", "construction_vehicle", "bus", "trailer",
               "barrier", "motorcycle", "bicycle", "pedestrian", "traffic_cone"]
PC_RANGE = [-51.2, -51.2, -5.0, 51.2, 51.2, 3.0]
VOXEL_SIZE = [0.2, 0.2, 8.0]
GRID = (512, 512)  # (x, y)
OUT_SIZE_FACTOR = 4

logger = logging.getLogger("cp_pillar")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", default="data/nuscenes")
    p.add_argument("--work-dir", default="work_dirs/cp_pillar")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=4, help="samples per GPU")
    p.add_argument("--lr", type=float, default=1e-3, help="max lr of the one-cycle, tuned for 8 GPUs x 4")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--sweeps", type=int, default=10)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--resume", default="")
    p.add_argument("--eval-interval", type=int, default=5)
    return p.parse_args()


class NuScenesSweepDataset(Dataset):
    def __init__(self, data_root, info_file, sweeps=10, training=True):
        self.data_root = data_root
        with open(os.path.join(data_root, info_file), "rb") as f:
            self.infos = pickle.load(f)["infos"]
        self.sweeps = sweeps
        self.training = training

    def __len__(self):
        return len(self.infos)

    def _load_points(self, path):
        pts = np.fromfile(os.path.join(self.data_root, path), dtype=np.float32)
        return pts.reshape(-1, 5)[:, :4]

    def __getitem__(self, idx):
        info = self.infos[idx]
        points = self._load_points(info["lidar_path"])
        all_pts = [np.concatenate([points, np.zeros((len(points), 1), np.float32)], 1)]
        for sweep in info["sweeps"][: self.sweeps - 1]:
            pts = self._load_points(sweep["data_path"])
            pts[:, :3] = pts[:, :3] @ sweep["sensor2lidar_rotation"].T + sweep["sensor2lidar_translation"]
            dt = (info["timestamp"] - sweep["timestamp"]) / 1e6
            all_pts.append(np.concatenate([pts, np.full((len(pts), 1), dt, np.float32)], 1))
        points = np.concatenate(all_pts, 0)

        names = info["gt_names"]
        keep = np.array([n in CLASS_NAMES for n in names], dtype=bool)
        boxes = info["gt_boxes"][keep].astype(np.float32)  # x y z w l h yaw vx vy
        labels = np.array([CLASS_NAMES.index(n) for n in names[keep]], dtype=np.int64)
        if self.training:
            points, boxes = self.augment(points, boxes)

        in_range = ((points[:, 0] > PC_RANGE[0]) & (points[:, 0] < PC_RANGE[3])
                    & (points[:, 1] > PC_RANGE[1]) & (points[:, 1] < PC_RANGE[4]))
        return {
            "points": torch.from_numpy(points[in_range]),
            "gt_boxes": torch.from_numpy(boxes),
            "gt_labels": torch.from_numpy(labels),
            "token": info["token"],
        }

    @staticmethod
    def augment(points, boxes):
        angle = np.random.uniform(-np.pi / 4, np.pi / 4)
        c, s = np.cos(angle), np.sin(angle)
        rot = np.array([[c, -s], [s, c]], dtype=np.float32)
        points[:, :2] = points[:, :2] @ rot.T
        boxes[:, :2] = boxes[:, :2] @ rot.T
        boxes[:, 7:9] = boxes[:, 7:9] @ rot.T
        boxes[:, 6] += angle
        scale = np.random.uniform(0.95, 1.05)
        points[:, :3] *= scale
        boxes[:, :6] *= scale
        boxes[:, 7:9] *= scale
        if np.random.rand() < 0.5:
            points[:, 1] = -points[:, 1]
            boxes[:, 1] = -boxes[:, 1]
            boxes[:, 6] = -boxes[:, 6]
            boxes[:, 8] = -boxes[:, 8]
        return points, boxes


def collate_points(batch):
    points = [F.pad(s["points"], (1, 0), value=float(i)) for i, s in enumerate(batch)]
    return {
        "points": torch.cat(points, 0),
        "gt_boxes": [s["gt_boxes"] for s in batch],
        "gt_labels": [s["gt_labels"] for s in batch],
        "tokens": [s["token"] for s in batch],
    }


class PillarEncoder(nn.Module):
    def __init__(self, in_ch=5, out_ch=64):
        super().__init__()
        self.out_ch = out_ch
        self.voxelizer = Voxelization(VOXEL_SIZE, PC_RANGE, max_num_points=20, max_voxels=(30000, 40000))
        self.linear = nn.Linear(in_ch + 5, out_ch, bias=False)
        self.norm = nn.BatchNorm1d(out_ch, eps=1e-3, momentum=0.01)

    def forward(self, points, batch_size):
        canvases = []
        for b in range(batch_size):
            voxels, coors, num = self.voxelizer(points[points[:, 0] == b, 1:].contiguous())
            mask = torch.arange(voxels.shape[1], device=voxels.device)[None] < num[:, None]
            mean = voxels[:, :, :3].sum(1, keepdim=True) / num.clamp(min=1)[:, None, None]
            cx = coors[:, 2].float() * VOXEL_SIZE[0] + VOXEL_SIZE[0] / 2 + PC_RANGE[0]
            cy = coors[:, 1].float() * VOXEL_SIZE[1] + VOXEL_SIZE[1] / 2 + PC_RANGE[1]
            center = torch.stack([voxels[..., 0] - cx[:, None], voxels[..., 1] - cy[:, None]], -1)
            feats = torch.cat([voxels, voxels[:, :, :3] - mean, center], -1) * mask[..., None]
            x = self.linear(feats)
            x = F.relu(self.norm(x.permute(0, 2, 1)).permute(0, 2, 1))
            x = x.max(dim=1)[0]
            canvas = x.new_zeros(self.out_ch, GRID[0] * GRID[1])
            canvas[:, coors[:, 1] * GRID[0] + coors[:, 2]] = x.t()
            canvases.append(canvas.view(self.out_ch, GRID[1], GRID[0]))
        return torch.stack(canvases, 0)


def conv_bn(cin, cout, stride=1):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
                         nn.BatchNorm2d(cout, eps=1e-3, momentum=0.01), nn.ReLU(inplace=True))


class CenterPointPillar(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.encoder = PillarEncoder()
        self.block1 = nn.Sequential(conv_bn(64, 64, 2), *[conv_bn(64, 64) for _ in range(3)])
        self.block2 = nn.Sequential(conv_bn(64, 128, 2), *[conv_bn(128, 128) for _ in range(5)])
        self.block3 = nn.Sequential(conv_bn(128, 256, 2), *[conv_bn(256, 256) for _ in range(5)])
        self.up1 = conv_bn(64, 128, 2)
        self.up2 = conv_bn(128, 128)
        self.up3 = nn.Sequential(nn.ConvTranspose2d(256, 128, 2, 2, bias=False),
                                 nn.BatchNorm2d(128, eps=1e-3, momentum=0.01), nn.ReLU(inplace=True))
        self.shared = conv_bn(384, 64)
        self.hm = nn.Sequential(conv_bn(64, 64), nn.Conv2d(64, num_classes, 1))
        self.reg = nn.Sequential(conv_bn(64, 64), nn.Conv2d(64, 10, 1))  # off2 z1 dim3 rot2 vel2
        self.hm[-1].bias.data.fill_(-2.19)

    def forward(self, points, batch_size):
        x = self.encoder(points, batch_size)
        x1 = self.block1(x)
        x2 = self.block2(x1)
        x3 = self.block3(x2)
        x = self.shared(torch.cat([self.up1(x1), self.up2(x2), self.up3(x3)], 1))
        return self.hm(x), self.reg(x)


def focal_loss(pred, target):
    pred = pred.sigmoid().clamp(1e-4, 1 - 1e-4)
    pos = target.eq(1).float()
    neg = 1 - pos
    pos_loss = torch.log(pred) * (1 - pred) ** 2 * pos
    neg_loss = torch.log(1 - pred) * pred ** 2 * (1 - target) ** 4 * neg
    num_pos = pos.sum().clamp(min=1)
    return -(pos_loss.sum() + neg_loss.sum()) / num_pos


def train_one_epoch(model, loader, optimizer, scheduler, assigner, epoch, device):
    model.train()
    t0 = time.time()
    for it, batch in enumerate(loader):
        points = batch["points"].to(device, non_blocking=True)
        bs = len(batch["tokens"])
        hm, reg = model(points, bs)
        tgt = assigner.assign([b.to(device) for b in batch["gt_boxes"]],
                              [l.to(device) for l in batch["gt_labels"]])
        loss_hm = focal_loss(hm, tgt["heatmap"])
        pred = reg.flatten(2).gather(2, tgt["ind"][:, None].expand(-1, reg.shape[1], -1)).permute(0, 2, 1)
        mask = tgt["mask"][..., None].float()
        loss_reg = (F.l1_loss(pred, tgt["reg"], reduction="none") * mask).sum() / mask.sum().clamp(min=1)
        loss = loss_hm + 0.25 * loss_reg

        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 35.0)
        optimizer.step()
        scheduler.step()

        if it % 50 == 0 and dist.get_rank() == 0:
            logger.info("epoch %d iter %d/%d loss %.4f (hm %.4f reg %.4f) lr %.2e %.2fs/it",
                        epoch, it, len(loader), loss.item(), loss_hm.item(), loss_reg.item(),
                        optimizer.param_groups[0]["lr"], (time.time() - t0) / (it + 1))


@torch.no_grad()
def evaluate(model, loader, device, work_dir, data_root):
    model.eval()
    results = {}
    for batch in loader:
        hm, reg = model(batch["points"].to(device, non_blocking=True), len(batch["tokens"]))
        dets = decode_center_heatmap(hm, reg, PC_RANGE, VOXEL_SIZE, OUT_SIZE_FACTOR, score_thr=0.1)
        for token, det in zip(batch["tokens"], dets):
            results[token] = {k: v.cpu().numpy() for k, v in det.items()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    metrics = None
    if dist.get_rank() == 0:
        merged = {}
        for part in gathered:
            merged.update(part)  # the sampler pads the last shard, duplicates collapse on token
        metrics = nuscenes_evaluate(merged, CLASS_NAMES, data_root, os.path.join(work_dir, "eval"))
        logger.info("mAP %.4f NDS %.4f", metrics["mAP"], metrics["NDS"])
        with open(os.path.join(work_dir, "metrics.json"), "a") as f:
            f.write(json.dumps(metrics) + "\n")
    model.train()
    return metrics


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)
    torch.manual_seed(0)

    train_set = NuScenesSweepDataset(args.data_root, "nuscenes_infos_train.pkl", args.sweeps, training=True)
    val_set = NuScenesSweepDataset(args.data_root, "nuscenes_infos_val.pkl", args.sweeps, training=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, collate_fn=collate_points, pin_memory=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=args.workers, collate_fn=collate_points, pin_memory=True)

    model = CenterPointPillar(num_classes=len(CLASS_NAMES))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr,
                                                    total_steps=args.epochs * len(train_loader),
                                                    pct_start=0.4, div_factor=10.0)
    assigner = CenterTargetAssigner(PC_RANGE, VOXEL_SIZE, OUT_SIZE_FACTOR,
                                    num_classes=len(CLASS_NAMES), max_objs=500, min_radius=2)

    start_epoch = 0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1
        logger.info("resumed from %s (epoch %d)", args.resume, ckpt["epoch"])

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        train_one_epoch(model, train_loader, optimizer, scheduler, assigner, epoch, device)
        if rank == 0:
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch}
            torch.save(state, os.path.join(args.work_dir, f"epoch_{epoch + 1}.pth"))
            torch.save(state, os.path.join(args.work_dir, "latest.pth"))
        dist.barrier()
        if (epoch + 1) % args.eval_interval == 0 or epoch + 1 == args.epochs:
            evaluate(model, val_loader, device, args.work_dir, args.data_root)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
