"""Multi-sweep lidar detector on Argoverse 2 (sensor dataset), 26 classes.

The official val split is kept for the final report; for the sweep over the
sweep count / voxel size we carve a log-level holdout out of the train logs.

    torchrun --nproc_per_node=8 train_av2_sweeps.py --av2-root /data/av2/sensor --nsweeps 5 \
        --holdout-frac 0.1 --out /ckpt/av2_cp_5sw
"""
import argparse
import json
import os
import random
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from scipy.spatial.transform import Rotation
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from av3d.models import CenterPointVoxel
from av3d.eval.av2 import av2_cds_eval

AV2_CLASSES = ["REGULAR_VEHICLE", "PEDESTRIAN", "BOLLARD", "CONSTRUCTION_CONE", "CONSTRUCTION_BARREL",
               "STOP_SIGN", "BICYCLE", "LARGE_VEHICLE", "WHEELED_DEVICE", "BUS", "BOX_TRUCK", "SIGN",
               "TRUCK", "MOTORCYCLE", "BICYCLIST", "VEHICULAR_TRAILER", "TRUCK_CAB", "MOTORCYCLIST", "DOG",
               "SCHOOL_BUS", "WHEELED_RIDER", "STROLLER", "ARTICULATED_BUS", "MESSAGE_BOARD_TRAILER",
               "MOBILE_PEDESTRIAN_SIGN", "WHEELCHAIR"]
PC_RANGE = [-152.4, -152.4, -5.0, 152.4, 152.4, 5.0]


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def pose_matrix(row):
    T = np.eye(4)
    T[:3, :3] = Rotation.from_quat([row.qx, row.qy, row.qz, row.qw]).as_matrix()
    T[:3, 3] = [row.tx_m, row.ty_m, row.tz_m]
    return T


class AV2Sweeps(Dataset):
    def __init__(self, root, logs, nsweeps, training):
        self.root, self.nsweeps, self.training = Path(root), nsweeps, training
        self.frames = []
        for log in logs:
            ts = sorted(int(p.stem) for p in (self.root / log / "sensors" / "lidar").glob("*.feather"))
            poses = pd.read_feather(self.root / log / "city_SE3_egovehicle.feather").set_index("timestamp_ns")
            for i, t in enumerate(ts):
                self.frames.append((log, t, ts[max(0, i - nsweeps + 1): i][::-1], poses))

    def __len__(self):
        return len(self.frames)

    def __getitem__(self, idx):
        log, t, prev, poses = self.frames[idx]
        ego_t = pose_matrix(poses.loc[t])
        lidar_dir = self.root / log / "sensors" / "lidar"
        df = pd.read_feather(lidar_dir / f"{t}.feather")
        clouds = [np.stack([df.x, df.y, df.z, df.intensity / 255.0, np.zeros(len(df))], 1)]
        for tp in prev:
            d = pd.read_feather(lidar_dir / f"{tp}.feather")
            xyz = np.stack([d.x, d.y, d.z, np.ones(len(d))], 1)
            xyz = (np.linalg.inv(ego_t) @ pose_matrix(poses.loc[tp]) @ xyz.T).T[:, :3]
            clouds.append(np.concatenate([xyz, d.intensity.values[:, None] / 255.0,
                                          np.full((len(d), 1), (t - tp) * 1e-9)], 1))
        pts = np.concatenate(clouds).astype(np.float32)
        ann = pd.read_feather(self.root / log / "annotations.feather")
        ann = ann[(ann.timestamp_ns == t) & ann.category.isin(AV2_CLASSES) & (ann.num_interior_pts > 0)]
        yaw = Rotation.from_quat(ann[["qx", "qy", "qz", "qw"]].values).as_euler("xyz")[:, 2] if len(ann) else np.zeros(0)
        boxes = np.stack([ann.tx_m, ann.ty_m, ann.tz_m, ann.length_m, ann.width_m, ann.height_m, yaw], 1)
        labels = np.array([AV2_CLASSES.index(c) for c in ann.category], np.int64)
        if self.training and np.random.rand() < 0.5:
            pts[:, 1] = -pts[:, 1]
            boxes[:, 1] = -boxes[:, 1]
            boxes[:, 6] = -boxes[:, 6]
        return {"points": torch.from_numpy(pts), "gt_boxes": torch.from_numpy(boxes.astype(np.float32)),
                "gt_labels": torch.from_numpy(labels), "key": f"{log}/{t}"}


def collate(batch):
    return {k: [b[k] for b in batch] for k in ("points", "gt_boxes", "gt_labels", "key")}


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    dets, gts = {}, {}
    for b in loader:
        out = model([p.cuda(non_blocking=True) for p in b["points"]])
        for key, det, gb, gl in zip(b["key"], model.module.predict(out), b["gt_boxes"], b["gt_labels"]):
            dets[key] = {k: v.cpu().numpy() for k, v in det.items()}
            gts[key] = {"boxes": gb.numpy(), "labels": gl.numpy()}
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (dets, gts))
    model.train()
    if dist.get_rank() != 0:
        return None
    all_d, all_g = {}, {}
    for d, g in parts:
        all_d.update(d)
        all_g.update(g)
    return av2_cds_eval(all_d, all_g, AV2_CLASSES)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--av2-root", required=True)
    ap.add_argument("--nsweeps", type=int, default=5)
    ap.add_argument("--holdout-frac", type=float, default=0.1)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    seed_everything(args.seed + rank)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    logs = sorted(p.name for p in (Path(args.av2_root) / "train").iterdir() if p.is_dir())
    random.shuffle(logs)
    n_hold = int(len(logs) * args.holdout_frac)
    holdout_logs, train_logs = logs[:n_hold], logs[n_hold:]
    if rank == 0:
        with open(os.path.join(args.out, "split.json"), "w") as f:
            json.dump({"train": train_logs, "holdout": holdout_logs}, f)
        print(f"{len(train_logs)} train logs, {len(holdout_logs)} holdout logs", flush=True)

    train_set = AV2Sweeps(os.path.join(args.av2_root, "train"), train_logs, args.nsweeps, training=True)
    hold_set = AV2Sweeps(os.path.join(args.av2_root, "train"), holdout_logs, args.nsweeps, training=False)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.bs, sampler=sampler, num_workers=8, collate_fn=collate,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    hold_loader = DataLoader(hold_set, batch_size=args.bs, sampler=DistributedSampler(hold_set, shuffle=False),
                             num_workers=8, collate_fn=collate)

    model = CenterPointVoxel(pc_range=PC_RANGE, voxel_size=[0.2, 0.2, 0.25], num_classes=len(AV2_CLASSES),
                             in_channels=5, sparse_shape_from_range=True)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda()
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(train_loader),
                                                pct_start=0.4)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, b in enumerate(train_loader):
            out = model([p.cuda(non_blocking=True) for p in b["points"]])
            losses = model.module.loss(out, [x.cuda() for x in b["gt_boxes"]], [x.cuda() for x in b["gt_labels"]])
            loss = sum(losses.values())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 35.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"ep {epoch} it {it}/{len(train_loader)} loss {loss.item():.4f} "
                      f"{(time.time() - t0) / (it + 1):.2f}s/it", flush=True)
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "args": vars(args)},
                       os.path.join(args.out, "latest.pth"))
        if (epoch + 1) % 3 == 0:
            m = evaluate(model, hold_loader)
            if rank == 0:
                print(f"holdout epoch {epoch + 1}: mAP {m['mAP']:.4f} CDS {m['CDS']:.4f}", flush=True)
                with open(os.path.join(args.out, "holdout_metrics.jsonl"), "a") as f:
                    f.write(json.dumps({"epoch": epoch + 1, **m}) + "\n")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
