"""CenterPoint-Voxel on nuScenes (10 sweeps), six class-group heads, loss computed inside the detector.

Uses GT-database sampling with the "fade" schedule (no copy-paste in the last epochs).

    torchrun --nproc_per_node=8 03_centerpoint_nusc.py --data_path /datasets/nuscenes/v1.0-trainval
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
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from pcdet_lite.augmentor import DataBaseSampler, random_flip_along_x, random_flip_along_y, global_rotation
from pcdet_lite.nuscenes_utils import load_sweep_points, nuscenes_center_distance_ap

TASKS = [["car"], ["truck", "construction_vehicle"], ["bus", "trailer"], ["barrier"],
         ["motorcycle", "bicycle"], ["pedestrian", "traffic_cone"]]
CLASS_NAMES = [c for t in TASKS for c in t]
POINT_CLOUD_RANGE = np.array([-54.0, -54.0, -5.0, 54.0, 54.0, 3.0], dtype=np.float32)
VOXEL_SIZE = np.array([0.075, 0.075, 0.2], dtype=np.float32)
GRID_SIZE = np.round((POINT_CLOUD_RANGE[3:] - POINT_CLOUD_RANGE[:3]) / VOXEL_SIZE).astype(np.int64)  # 1440 1440 40
FEATURE_STRIDE = 8

log = logging.getLogger(__name__)


class NuScenesDataset(Dataset):
    def __init__(self, data_path, split, training, db_sampler=None):
        self.data_path, self.training, self.db_sampler = data_path, training, db_sampler
        with open(os.path.join(data_path, f"nuscenes_infos_10sweeps_{split}.pkl"), "rb") as f:
            self.infos = pickle.load(f)
        self.use_db_sampling = training and db_sampler is not None

    def __len__(self):
        return len(self.infos)

    def voxelize(self, points, max_points=10, max_voxels=120000):
        ijk = ((points[:, :3] - POINT_CLOUD_RANGE[:3]) / VOXEL_SIZE).astype(np.int64)
        key = (ijk[:, 2] * GRID_SIZE[1] + ijk[:, 1]) * GRID_SIZE[0] + ijk[:, 0]
        order = np.argsort(key, kind="stable")
        points, ijk, key = points[order], ijk[order], key[order]
        _, first, counts = np.unique(key, return_index=True, return_counts=True)
        slot = np.arange(len(key)) - np.repeat(first, counts)
        keep = slot < max_points
        feat = np.zeros((len(first), points.shape[1]), np.float32)
        np.add.at(feat, np.repeat(np.arange(len(first)), counts)[keep], points[keep])
        feat /= np.minimum(counts, max_points)[:, None]
        coords = ijk[first][:, ::-1].astype(np.int32)
        if len(first) > max_voxels:
            sel = np.random.choice(len(first), max_voxels, replace=False)
            feat, coords = feat[sel], coords[sel]
        return feat, coords

    def __getitem__(self, index):
        info = self.infos[index]
        points = load_sweep_points(self.data_path, info, max_sweeps=10)  # (N, 5): x y z intensity dt
        mask = np.isin(info["gt_names"], CLASS_NAMES) & (info["num_lidar_pts"] > 0)
        gt_boxes = np.nan_to_num(info["gt_boxes"][mask]).astype(np.float32)  # x y z dx dy dz yaw vx vy
        gt_names = info["gt_names"][mask]
        if self.training:
            if self.use_db_sampling:
                points, gt_boxes, gt_names = self.db_sampler(points, gt_boxes, gt_names)
            points, gt_boxes = random_flip_along_x(points, gt_boxes)
            points, gt_boxes = random_flip_along_y(points, gt_boxes)
            points, gt_boxes = global_rotation(points, gt_boxes, rot_range=(-0.785, 0.785))
        in_range = np.all((points[:, :3] >= POINT_CLOUD_RANGE[:3]) & (points[:, :3] < POINT_CLOUD_RANGE[3:]), axis=1)
        points = points[in_range]
        box_in = np.all((gt_boxes[:, :2] >= POINT_CLOUD_RANGE[:2]) & (gt_boxes[:, :2] < POINT_CLOUD_RANGE[3:5]), axis=1)
        gt_boxes, gt_names = gt_boxes[box_in], gt_names[box_in]
        feat, coords = self.voxelize(points)
        labels = np.array([CLASS_NAMES.index(n) + 1 for n in gt_names], np.float32).reshape(-1, 1)
        return {"voxel_features": feat, "voxel_coords": coords, "token": info["token"],
                "gt_boxes": np.concatenate([gt_boxes.reshape(-1, 9), labels], axis=1)}

    @staticmethod
    def collate_batch(batch_list):
        n_max = max(1, max(len(b["gt_boxes"]) for b in batch_list))
        gt = np.zeros((len(batch_list), n_max, 10), np.float32)
        for i, b in enumerate(batch_list):
            gt[i, :len(b["gt_boxes"])] = b["gt_boxes"]
        coords = [np.pad(b["voxel_coords"], ((0, 0), (1, 0)), constant_values=i) for i, b in enumerate(batch_list)]
        return {"voxel_features": torch.from_numpy(np.concatenate([b["voxel_features"] for b in batch_list])),
                "voxel_coords": torch.from_numpy(np.concatenate(coords)), "gt_boxes": torch.from_numpy(gt),
                "tokens": [b["token"] for b in batch_list], "batch_size": len(batch_list)}


def post_act_block(cin, cout, indice_key, stride=1, padding=1, conv_type="subm", kernel_size=3):
    if conv_type == "subm":
        conv = spconv.SubMConv3d(cin, cout, kernel_size, bias=False, padding=padding, indice_key=indice_key)
    else:
        conv = spconv.SparseConv3d(cin, cout, kernel_size, stride=stride, padding=padding, bias=False, indice_key=indice_key)
    return spconv.SparseSequential(conv, nn.BatchNorm1d(cout, eps=1e-3, momentum=0.01), nn.ReLU())


def bev_conv(cin, cout, stride=1):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout, eps=1e-3, momentum=0.01), nn.ReLU())


class CenterHead(nn.Module):
    def __init__(self, in_channels=512):
        super().__init__()
        self.shared_conv = bev_conv(in_channels, 64)
        self.hm_heads, self.reg_heads = nn.ModuleList(), nn.ModuleList()
        for task in TASKS:
            self.hm_heads.append(nn.Sequential(bev_conv(64, 64), nn.Conv2d(64, len(task), 1)))
            self.reg_heads.append(nn.Sequential(bev_conv(64, 64), nn.Conv2d(64, 10, 1)))
            nn.init.constant_(self.hm_heads[-1][-1].bias, -2.19)
        self.code_weights = [1.0] * 8 + [0.2, 0.2]

    def assign_targets(self, gt_boxes, feat_hw, max_objs=500):
        """Heatmap / regression targets for one task, computed on GPU per sample."""
        H, W = feat_hw
        device = gt_boxes.device
        targets = []
        for task in TASKS:
            class_ids = [CLASS_NAMES.index(c) + 1 for c in task]
            hm = torch.zeros(gt_boxes.shape[0], len(task), H, W, device=device)
            reg = torch.zeros(gt_boxes.shape[0], max_objs, 10, device=device)
            ind = torch.zeros(gt_boxes.shape[0], max_objs, dtype=torch.long, device=device)
            mask = torch.zeros(gt_boxes.shape[0], max_objs, device=device)
            for b in range(gt_boxes.shape[0]):
                boxes = gt_boxes[b]
                boxes = boxes[torch.isin(boxes[:, 9].long(), torch.tensor(class_ids, device=device))][:max_objs]
                fx = (boxes[:, 0] - POINT_CLOUD_RANGE[0]) / VOXEL_SIZE[0] / FEATURE_STRIDE
                fy = (boxes[:, 1] - POINT_CLOUD_RANGE[1]) / VOXEL_SIZE[1] / FEATURE_STRIDE
                cx, cy = fx.long().clamp(0, W - 1), fy.long().clamp(0, H - 1)
                radius = (0.25 * torch.hypot(boxes[:, 3], boxes[:, 4]) / VOXEL_SIZE[0] / FEATURE_STRIDE).long().clamp(min=2)
                ys, xs = torch.meshgrid(torch.arange(H, device=device), torch.arange(W, device=device), indexing="ij")
                for k in range(len(boxes)):
                    c = class_ids.index(int(boxes[k, 9]))
                    sigma = (2 * radius[k] + 1).float() / 6
                    g = torch.exp(-((xs - cx[k]) ** 2 + (ys - cy[k]) ** 2).float() / (2 * sigma ** 2))
                    g[(torch.abs(xs - cx[k]) > radius[k]) | (torch.abs(ys - cy[k]) > radius[k])] = 0
                    hm[b, c] = torch.maximum(hm[b, c], g)
                    ind[b, k], mask[b, k] = cy[k] * W + cx[k], 1
                    reg[b, k] = torch.cat([torch.stack([fx[k] - cx[k], fy[k] - cy[k], boxes[k, 2]]), boxes[k, 3:6].log(),
                                           torch.stack([boxes[k, 6].sin(), boxes[k, 6].cos()]), boxes[k, 7:9]])
            targets.append((hm, reg, ind, mask))
        return targets

    def forward(self, bev):
        x = self.shared_conv(bev)
        return [(hm_head(x), reg_head(x)) for hm_head, reg_head in zip(self.hm_heads, self.reg_heads)]

    def get_loss(self, preds, gt_boxes):
        targets = self.assign_targets(gt_boxes, preds[0][0].shape[-2:])
        loss_hm, loss_reg = 0.0, 0.0
        weights = preds[0][1].new_tensor(self.code_weights)
        for (hm_logit, reg_map), (hm, reg, ind, mask) in zip(preds, targets):
            num_pos = mask.sum()
            if num_pos == 0:
                continue
            pred = hm_logit.sigmoid().clamp(1e-4, 1 - 1e-4)
            pos = hm.eq(1).float()
            focal = torch.log(pred) * (1 - pred) ** 2 * pos + torch.log(1 - pred) * pred ** 2 * (1 - hm) ** 4 * (1 - pos)
            loss_hm = loss_hm - focal.sum() / num_pos
            C = reg_map.shape[1]
            pr = reg_map.flatten(2).gather(2, ind.unsqueeze(1).expand(-1, C, -1)).transpose(1, 2)
            l1 = F.l1_loss(pr * mask.unsqueeze(-1), reg * mask.unsqueeze(-1), reduction="none") * weights
            loss_reg = loss_reg + l1.sum() / num_pos
        return loss_hm, loss_reg


class CenterPointVoxel(nn.Module):
    def __init__(self):
        super().__init__()
        self.sparse_shape = [int(GRID_SIZE[2]) + 1, int(GRID_SIZE[1]), int(GRID_SIZE[0])]
        self.backbone_3d = spconv.SparseSequential(
            post_act_block(5, 16, "subm1"), post_act_block(16, 16, "subm1"),
            post_act_block(16, 32, "spconv2", 2, 1, "spconv"), post_act_block(32, 32, "subm2"), post_act_block(32, 32, "subm2"),
            post_act_block(32, 64, "spconv3", 2, 1, "spconv"), post_act_block(64, 64, "subm3"), post_act_block(64, 64, "subm3"),
            post_act_block(64, 128, "spconv4", 2, (0, 1, 1), "spconv"), post_act_block(128, 128, "subm4"),
            post_act_block(128, 128, "spconv_down2", (2, 1, 1), 0, "spconv", kernel_size=(3, 1, 1)))
        self.bev_block1 = nn.Sequential(bev_conv(256, 128), *[bev_conv(128, 128) for _ in range(5)])
        self.bev_block2 = nn.Sequential(bev_conv(128, 256, 2), *[bev_conv(256, 256) for _ in range(5)])
        self.deblock1 = nn.Sequential(nn.Conv2d(128, 256, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU())
        self.deblock2 = nn.Sequential(nn.ConvTranspose2d(256, 256, 2, 2, bias=False), nn.BatchNorm2d(256), nn.ReLU())
        self.dense_head = CenterHead(512)

    def forward(self, batch):
        sp = spconv.SparseConvTensor(batch["voxel_features"], batch["voxel_coords"].int(), self.sparse_shape, batch["batch_size"])
        bev = self.backbone_3d(sp).dense().flatten(1, 2)
        x1 = self.bev_block1(bev)
        bev = torch.cat([self.deblock1(x1), self.deblock2(self.bev_block2(x1))], dim=1)
        preds = self.dense_head(bev)
        if self.training:
            loss_hm, loss_reg = self.dense_head.get_loss(preds, batch["gt_boxes"])
            return {"loss": loss_hm + 0.25 * loss_reg, "loss_hm": loss_hm, "loss_reg": loss_reg}
        return preds


def decode_preds(preds, tokens, topk=500, score_thr=0.1):
    out = {t: {"boxes": [], "scores": [], "labels": []} for t in tokens}
    offset = 0
    for (hm_logit, reg_map), task in zip(preds, TASKS):
        B, C, H, W = hm_logit.shape
        heat = hm_logit.sigmoid()
        heat = heat * (F.max_pool2d(heat, 3, 1, 1) == heat)
        scores, idx = heat.flatten(1).topk(topk)
        cls, pix = idx // (H * W), idx % (H * W)
        r = reg_map.flatten(2).gather(2, pix.unsqueeze(1).expand(-1, 10, -1)).transpose(1, 2)
        x = ((pix % W).float() + r[..., 0]) * FEATURE_STRIDE * float(VOXEL_SIZE[0]) + float(POINT_CLOUD_RANGE[0])
        y = ((pix // W).float() + r[..., 1]) * FEATURE_STRIDE * float(VOXEL_SIZE[1]) + float(POINT_CLOUD_RANGE[1])
        boxes = torch.cat([torch.stack([x, y], -1), r[..., 2:3], r[..., 3:6].exp(), torch.atan2(r[..., 6:7], r[..., 7:8]),
                           r[..., 8:10]], -1)
        for b, tok in enumerate(tokens):
            keep = scores[b] > score_thr
            out[tok]["boxes"].append(boxes[b][keep].cpu().numpy())
            out[tok]["scores"].append(scores[b][keep].cpu().numpy())
            out[tok]["labels"].append((cls[b][keep] + offset).cpu().numpy())
        offset += len(task)
    return {t: {k: np.concatenate(v) for k, v in d.items()} for t, d in out.items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data_path", default="/datasets/nuscenes/v1.0-trainval")
    parser.add_argument("--output_dir", default="output/centerpoint_voxel0075")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--fade_epochs", type=int, default=4, help="disable GT sampling for the last N epochs")
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--num_workers", type=int, default=4)
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING)
    tb = SummaryWriter(os.path.join(args.output_dir, "tensorboard")) if rank == 0 else None

    db_sampler = DataBaseSampler(args.data_path, "nuscenes_dbinfos_10sweeps_withvelo.pkl", CLASS_NAMES,
                                 sample_groups={"car": 2, "truck": 3, "construction_vehicle": 7, "bus": 4, "trailer": 6,
                                                "barrier": 2, "motorcycle": 6, "bicycle": 6, "pedestrian": 2, "traffic_cone": 2})
    train_set = NuScenesDataset(args.data_path, "train", True, db_sampler)
    val_set = NuScenesDataset(args.data_path, "val", False)
    train_sampler = DistributedSampler(train_set)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, num_workers=args.num_workers,
                              collate_fn=NuScenesDataset.collate_batch, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=args.num_workers, collate_fn=NuScenesDataset.collate_batch)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(CenterPointVoxel()).cuda()
    model = DistributedDataParallel(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, pct_start=0.4,
                                                    total_steps=args.epochs * len(train_loader))
    it = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        if epoch == args.epochs - args.fade_epochs:
            train_set.use_db_sampling = False
            log.info("GT sampling disabled from epoch %d", epoch)
            # persistent workers are not used, so the flag reaches the next epoch's workers
        model.train()
        for batch in train_loader:
            batch = {k: v.cuda(non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
            ret = model(batch)
            optimizer.zero_grad(set_to_none=True)
            ret["loss"].backward()
            nn.utils.clip_grad_norm_(model.parameters(), 35)
            optimizer.step()
            scheduler.step()
            it += 1
            if it % 50 == 0:
                vals = torch.stack([torch.as_tensor(ret[k], device="cuda").detach().float() for k in ("loss", "loss_hm", "loss_reg")])
                dist.all_reduce(vals, op=dist.ReduceOp.AVG)
                if rank == 0:
                    log.info("epoch %d iter %d loss %.4f hm %.4f reg %.4f", epoch, it, *vals.tolist())
                    for k, v in zip(("loss", "loss_hm", "loss_reg"), vals.tolist()):
                        tb.add_scalar(f"train/{k}", v, it)
        if rank == 0:
            os.makedirs(args.output_dir, exist_ok=True)
            torch.save({"model_state": model.module.state_dict(), "epoch": epoch},
                       os.path.join(args.output_dir, f"checkpoint_epoch_{epoch + 1}.pth"))

        if (epoch + 1) % 5 == 0:
            model.eval()
            local = {}
            with torch.no_grad():
                for batch in val_loader:
                    batch = {k: v.cuda(non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
                    local.update(decode_preds(model.module(batch), batch["tokens"]))
            gathered = [None] * world_size
            dist.all_gather_object(gathered, local)
            if rank == 0:
                merged = {k: v for part in gathered for k, v in part.items()}
                m_ap, aps = nuscenes_center_distance_ap(merged, val_set.infos, CLASS_NAMES)
                log.info("epoch %d mAP %.4f %s", epoch, m_ap, aps)
                tb.add_scalar("val/mAP", m_ap, epoch)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
