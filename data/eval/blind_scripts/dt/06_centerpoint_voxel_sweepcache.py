"""CenterPoint-Voxel (0.075) trained straight from the raw nuScenes devkit tables.

No offline info-generation step: the sample / sweep index (paths, sweep
transforms, filtered annotations) is built from the devkit on first use and
cached next to the data so later runs start in seconds.

    torchrun --nproc_per_node=8 train_cp_voxel.py --dataroot /data/sets/nuscenes --version v1.0-trainval
"""
import argparse
import hashlib
import logging
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from nuscenes.nuscenes import NuScenes
from nuscenes.utils.splits import create_splits_scenes
from pyquaternion import Quaternion
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from av3d.models import CenterPointVoxel
from av3d.datasets.transforms import GlobalRotScaleTrans, RandomFlip3D, ObjectRangeFilter
from av3d.eval import nuscenes_evaluate

CLASSES = ["car", "truck", "construction_vehicle", "bus", "trailer",
           "barrier", "motorcycle", "bicycle", "pedestrian", "traffic_cone"]
NAME_MAP = {"vehicle.car": "car", "vehicle.truck": "truck", "vehicle.construction": "construction_vehicle",
            "vehicle.bus.bendy": "bus", "vehicle.bus.rigid": "bus", "vehicle.trailer": "trailer",
            "movable_object.barrier": "barrier", "vehicle.motorcycle": "motorcycle", "vehicle.bicycle": "bicycle",
            "human.pedestrian.adult": "pedestrian", "human.pedestrian.child": "pedestrian",
            "human.pedestrian.construction_worker": "pedestrian", "human.pedestrian.police_officer": "pedestrian",
            "movable_object.trafficcone": "traffic_cone"}
PC_RANGE = [-54.0, -54.0, -5.0, 54.0, 54.0, 3.0]

logger = logging.getLogger("cp_voxel")


def _transform(translation, rotation, inverse=False):
    T = np.eye(4)
    R = Quaternion(rotation).rotation_matrix
    if inverse:
        T[:3, :3] = R.T
        T[:3, 3] = -R.T @ np.array(translation)
    else:
        T[:3, :3] = R
        T[:3, 3] = translation
    return T


class NuScenesLidarSweeps(Dataset):
    def __init__(self, dataroot, version, split, nsweeps=10, transforms=None):
        self.dataroot = dataroot
        self.nsweeps = nsweeps
        self.transforms = transforms or []
        key = hashlib.md5(f"{version}-{split}-{nsweeps}".encode()).hexdigest()[:8]
        cache_file = os.path.join(dataroot, ".cache", f"cp_index_{split}_{key}.pkl")
        if os.path.isfile(cache_file):
            with open(cache_file, "rb") as f:
                self.samples = pickle.load(f)
        else:
            self.samples = self._build_index(version, split)
            os.makedirs(os.path.dirname(cache_file), exist_ok=True)
            with open(cache_file, "wb") as f:
                pickle.dump(self.samples, f, protocol=pickle.HIGHEST_PROTOCOL)

    def _build_index(self, version, split):
        nusc = NuScenes(version=version, dataroot=self.dataroot, verbose=False)
        scenes = set(create_splits_scenes()[split])
        samples = []
        for sample in nusc.sample:
            if nusc.get("scene", sample["scene_token"])["name"] not in scenes:
                continue
            sd = nusc.get("sample_data", sample["data"]["LIDAR_TOP"])
            cs = nusc.get("calibrated_sensor", sd["calibrated_sensor_token"])
            pose = nusc.get("ego_pose", sd["ego_pose_token"])
            ref_from_global = _transform(cs["translation"], cs["rotation"], True) @ \
                _transform(pose["translation"], pose["rotation"], True)
            sweeps, cur = [], sd
            while len(sweeps) < self.nsweeps - 1 and cur["prev"]:
                cur = nusc.get("sample_data", cur["prev"])
                cs_s = nusc.get("calibrated_sensor", cur["calibrated_sensor_token"])
                pose_s = nusc.get("ego_pose", cur["ego_pose_token"])
                global_from_cur = _transform(pose_s["translation"], pose_s["rotation"]) @ \
                    _transform(cs_s["translation"], cs_s["rotation"])
                sweeps.append({"path": cur["filename"], "T": (ref_from_global @ global_from_cur).astype(np.float32),
                               "dt": (sd["timestamp"] - cur["timestamp"]) * 1e-6})
            boxes, labels = [], []
            for box in nusc.get_boxes(sd["token"]):
                ann = nusc.get("sample_annotation", box.token)
                name = NAME_MAP.get(box.name)
                if name is None or ann["num_lidar_pts"] + ann["num_radar_pts"] == 0:
                    continue
                box.translate(-np.array(pose["translation"]))
                box.rotate(Quaternion(pose["rotation"]).inverse)
                box.translate(-np.array(cs["translation"]))
                box.rotate(Quaternion(cs["rotation"]).inverse)
                vel = box.velocity if not np.any(np.isnan(box.velocity)) else np.zeros(3)
                vel = (Quaternion(cs["rotation"]).inverse.rotation_matrix @
                       Quaternion(pose["rotation"]).inverse.rotation_matrix @ vel)[:2]
                w, l, h = box.wlh
                boxes.append([*box.center, w, l, h, box.orientation.yaw_pitch_roll[0], *vel])
                labels.append(CLASSES.index(name))
            samples.append({"token": sample["token"], "lidar": sd["filename"], "sweeps": sweeps,
                            "boxes": np.array(boxes, np.float32).reshape(-1, 9),
                            "labels": np.array(labels, np.int64)})
        return samples

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        s = self.samples[idx]
        pts = np.fromfile(os.path.join(self.dataroot, s["lidar"]), np.float32).reshape(-1, 5)
        pts[:, 4] = 0
        clouds = [pts]
        for sw in s["sweeps"]:
            p = np.fromfile(os.path.join(self.dataroot, sw["path"]), np.float32).reshape(-1, 5)
            near = np.linalg.norm(p[:, :2], axis=1) < 1.0  # ego vehicle roof returns
            p = p[~near]
            p[:, :3] = p[:, :3] @ sw["T"][:3, :3].T + sw["T"][:3, 3]
            p[:, 4] = sw["dt"]
            clouds.append(p)
        data = {"points": np.concatenate(clouds), "gt_boxes": s["boxes"].copy(), "gt_labels": s["labels"].copy()}
        for t in self.transforms:
            data = t(data)
        return {"points": torch.from_numpy(data["points"]), "gt_boxes": torch.from_numpy(data["gt_boxes"]),
                "gt_labels": torch.from_numpy(data["gt_labels"]), "token": s["token"]}


def collate(batch):
    return {
        "points": [b["points"] for b in batch],
        "gt_boxes": [b["gt_boxes"] for b in batch],
        "gt_labels": [b["gt_labels"] for b in batch],
        "tokens": [b["token"] for b in batch],
    }


@torch.no_grad()
def evaluate(model, loader, args):
    model.eval()
    preds = {}
    for batch in loader:
        out = model([p.cuda(non_blocking=True) for p in batch["points"]])
        for tok, det in zip(batch["tokens"], model.module.predict(out)):
            preds[tok] = {k: v.cpu() for k, v in det.items()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, preds)
    model.train()
    if dist.get_rank() == 0:
        merged = {}
        for g in gathered:
            merged.update(g)
        return nuscenes_evaluate(merged, CLASSES, args.dataroot, os.path.join(args.work_dir, "eval"),
                                 version=args.version)
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataroot", default="/data/sets/nuscenes")
    ap.add_argument("--version", default="v1.0-trainval")
    ap.add_argument("--work-dir", default="work_dirs/cp_voxel_0075")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4, help="per 8 samples, scaled linearly")
    ap.add_argument("--num-workers", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [%(name)s] %(message)s")
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)

    train_tf = [GlobalRotScaleTrans(rot=(-0.785, 0.785), scale=(0.9, 1.1), trans_std=0.5),
                RandomFlip3D(bev_x=0.5, bev_y=0.5), ObjectRangeFilter(PC_RANGE)]
    train_set = NuScenesLidarSweeps(args.dataroot, args.version, "train", transforms=train_tf)
    val_set = NuScenesLidarSweeps(args.dataroot, args.version, "val", transforms=[ObjectRangeFilter(PC_RANGE)])
    logger.info("train %d samples, val %d samples", len(train_set), len(val_set))

    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, collate_fn=collate,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=DistributedSampler(val_set, shuffle=False),
                            collate_fn=collate, num_workers=args.num_workers)

    model = CenterPointVoxel(pc_range=PC_RANGE, voxel_size=[0.075, 0.075, 0.2], num_classes=len(CLASSES))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda()
    model = DDP(model, device_ids=[local_rank])

    lr = args.lr * args.batch_size * world / 8
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr * 10, total_steps=args.epochs * len(train_loader),
                                                    pct_start=0.4)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, batch in enumerate(train_loader):
            out = model([p.cuda(non_blocking=True) for p in batch["points"]])
            losses = model.module.loss(out, [b.cuda() for b in batch["gt_boxes"]], [l.cuda() for l in batch["gt_labels"]])
            loss = sum(losses.values())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 35)
            optimizer.step()
            scheduler.step()
            if it % 50 == 0 and rank == 0:
                logger.info("[%d][%d/%d] loss=%.4f hm=%.4f bbox=%.4f (%.1f s)", epoch, it, len(train_loader),
                            loss.item(), losses["hm"].item(), losses["bbox"].item(), time.time() - t0)
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch},
                       os.path.join(args.work_dir, f"epoch_{epoch + 1}.pth"))
        if (epoch + 1) % 4 == 0 or epoch + 1 == args.epochs:
            metrics = evaluate(model, val_loader, args)
            if rank == 0:
                logger.info("epoch %d  mAP %.4f  NDS %.4f", epoch + 1, metrics["mAP"], metrics["NDS"])
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
