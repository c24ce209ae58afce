"""Pillar detector on our fleet data (roof + 2 bumper lidars, merged in the vehicle frame).

Frames come from the logs exporter as one .npz per frame:
    points  (N, 5)  x y z intensity lidar_id   (vehicle frame)
    boxes   (M, 7)  x y z l w h yaw
    classes (M,)    str

Launch on one 8-GPU box:
    torchrun --standalone --nproc_per_node=8 train_pillar_fleet.py --train-list lists/train_v7.txt \
        --val-list lists/val_v7.txt --out /mnt/exp/pillar_fleet_v7
"""
import argparse
import json
import logging
import os
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
from av3d.models.heads import CenterHead
from av3d.eval.fleet import match_and_score

CLASSES = ["vehicle", "truck", "pedestrian", "cyclist"]
PC_RANGE = [-80.0, -40.0, -3.0, 120.0, 40.0, 3.0]
VOXEL = [0.25, 0.25, 6.0]
NX, NY = 800, 320

logger = logging.getLogger("pillar_fleet")


def to_device(batch, device="cuda:0"):
    out = {}
    for k, v in batch.items():
        if torch.is_tensor(v):
            out[k] = v.to(device, non_blocking=True)
        elif isinstance(v, list) and v and torch.is_tensor(v[0]):
            out[k] = [x.to(device, non_blocking=True) for x in v]
        else:
            out[k] = v
    return out


class FleetFrames(Dataset):
    def __init__(self, list_file, training):
        with open(list_file) as f:
            self.files = [l.strip() for l in f if l.strip()]
        self.training = training

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = np.load(self.files[i], allow_pickle=False)
        pts = d["points"].astype(np.float32)
        boxes = d["boxes"].astype(np.float32)
        names = d["classes"]
        keep = np.isin(names, CLASSES)
        boxes, labels = boxes[keep], np.array([CLASSES.index(n) for n in names[keep]], np.int64)
        if self.training:
            if np.random.rand() < 0.5:  # left/right mirror only, the range is not symmetric in x
                pts[:, 1] *= -1
                boxes[:, 1] *= -1
                boxes[:, 6] *= -1
            noise = np.random.uniform(-0.3925, 0.3925)
            c, s = np.cos(noise), np.sin(noise)
            R = np.array([[c, -s], [s, c]], np.float32)
            pts[:, :2] = pts[:, :2] @ R.T
            boxes[:, :2] = boxes[:, :2] @ R.T
            boxes[:, 6] += noise
            pts[:, 3] *= np.random.uniform(0.9, 1.1)
        m = ((pts[:, 0] > PC_RANGE[0]) & (pts[:, 0] < PC_RANGE[3]) &
             (pts[:, 1] > PC_RANGE[1]) & (pts[:, 1] < PC_RANGE[4]) &
             (pts[:, 2] > PC_RANGE[2]) & (pts[:, 2] < PC_RANGE[5]))
        lidar_onehot = np.eye(3, dtype=np.float32)[pts[m, 4].astype(np.int64)]
        points = np.concatenate([pts[m, :4], lidar_onehot], 1)
        return {"points": torch.from_numpy(points), "boxes": torch.from_numpy(boxes),
                "labels": torch.from_numpy(labels), "frame": os.path.basename(self.files[i])}


def collate(samples):
    return {
        "points": torch.cat([F.pad(s["points"], (1, 0), value=b) for b, s in enumerate(samples)]),
        "boxes": [s["boxes"] for s in samples],
        "labels": [s["labels"] for s in samples],
        "frames": [s["frame"] for s in samples],
    }


class PillarNet(nn.Module):
    def __init__(self, in_ch=7):
        super().__init__()
        self.vox = Voxelization(VOXEL, PC_RANGE, max_num_points=32, max_voxels=(60000, 60000))
        self.pfn = nn.Linear(in_ch + 5, 64, bias=False)
        self.pfn_norm = nn.BatchNorm1d(64, eps=1e-3, momentum=0.01)

        def stage(cin, cout, n, stride):
            layers = [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(True)]
            for _ in range(n):
                layers += [nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(True)]
            return nn.Sequential(*layers)

        self.s1, self.s2, self.s3 = stage(64, 64, 3, 1), stage(64, 128, 5, 2), stage(128, 256, 5, 2)
        self.u1 = nn.Sequential(nn.Conv2d(64, 128, 3, 2, 1, bias=False), nn.BatchNorm2d(128), nn.ReLU(True))
        self.u2 = nn.Sequential(nn.Conv2d(128, 128, 1, bias=False), nn.BatchNorm2d(128), nn.ReLU(True))
        self.u3 = nn.Sequential(nn.ConvTranspose2d(256, 128, 2, 2, bias=False), nn.BatchNorm2d(128), nn.ReLU(True))
        self.head = CenterHead(384, tasks=[["vehicle", "truck"], ["pedestrian", "cyclist"]], out_size_factor=2,
                               bbox_code_size=7, pc_range=PC_RANGE, voxel_size=VOXEL)

    def scatter(self, points, bs):
        canvases = []
        for b in range(bs):
            v, c, n = self.vox(points[points[:, 0] == b, 1:].contiguous())
            valid = (torch.arange(v.shape[1], device=v.device)[None] < n[:, None]).unsqueeze(-1).float()
            mean = (v[..., :3] * valid).sum(1, keepdim=True) / n.clamp(min=1).view(-1, 1, 1)
            cx = c[:, 2:3].float() * VOXEL[0] + VOXEL[0] / 2 + PC_RANGE[0]
            cy = c[:, 1:2].float() * VOXEL[1] + VOXEL[1] / 2 + PC_RANGE[1]
            f = torch.cat([v, v[..., :3] - mean, (v[..., 0] - cx)[..., None], (v[..., 1] - cy)[..., None]], -1)
            f = self.pfn(f * valid)
            f = F.relu(self.pfn_norm(f.transpose(1, 2)).transpose(1, 2)).max(1)[0]
            canvas = f.new_zeros(64, NY * NX)
            canvas[:, c[:, 1].long() * NX + c[:, 2].long()] = f.t()
            canvases.append(canvas.view(64, NY, NX))
        return torch.stack(canvases)

    def forward(self, points, bs):
        x = self.scatter(points, bs)
        x1 = self.s1(x)
        x2 = self.s2(x1)
        x3 = self.s3(x2)
        return self.head(torch.cat([self.u1(x1), self.u2(x2), self.u3(x3)], 1))


@torch.no_grad()
def validate(model, loader, out_dir, epoch):
    model.eval()
    preds, gts = {}, {}
    for batch in loader:
        batch = to_device(batch)
        out = model(batch["points"], len(batch["frames"]))
        for f, det, gb, gl in zip(batch["frames"], model.module.head.decode(out, score_thr=0.2),
                                  batch["boxes"], batch["labels"]):
            preds[f] = {k: v.cpu().numpy() for k, v in det.items()}
            gts[f] = {"boxes": gb.cpu().numpy(), "labels": gl.cpu().numpy()}
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (preds, gts))
    model.train()
    if dist.get_rank() != 0:
        return None
    all_p, all_g = {}, {}
    for p, g in parts:
        all_p.update(p)
        all_g.update(g)
    metrics = match_and_score(all_p, all_g, CLASSES, iou_thr={"vehicle": 0.7, "truck": 0.7,
                                                              "pedestrian": 0.5, "cyclist": 0.5})
    with open(os.path.join(out_dir, f"val_epoch{epoch}.json"), "w") as fh:
        json.dump(metrics, fh, indent=1)
    return metrics


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-list", required=True)
    ap.add_argument("--val-list", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=36)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    train_ds, val_ds = FleetFrames(args.train_list, True), FleetFrames(args.val_list, False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=1234)
    train_dl = DataLoader(train_ds, batch_size=args.batch, sampler=train_sampler, num_workers=args.workers,
                          collate_fn=collate, pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch, sampler=DistributedSampler(val_ds, shuffle=False),
                        num_workers=args.workers, collate_fn=collate, pin_memory=True)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(PillarNet()).cuda(local_rank)
    model = DDP(net, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(train_dl),
                                                pct_start=0.3)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, batch in enumerate(train_dl):
            batch = to_device(batch)
            out = model(batch["points"], len(batch["frames"]))
            losses = model.module.head.loss(out, batch["boxes"], batch["labels"])
            loss = sum(losses.values())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 35.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 100 == 0:
                logger.info("ep %02d it %05d/%d loss %.4f %s lr %.2e %.2fs/it", epoch, it, len(train_dl), loss.item(),
                            " ".join(f"{k}={v.item():.3f}" for k, v in losses.items()), sched.get_last_lr()[0],
                            (time.time() - t0) / (it + 1))
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, os.path.join(args.out, "last.pth"))
        if (epoch + 1) % 6 == 0 or epoch + 1 == args.epochs:
            m = validate(model, val_dl, args.out, epoch + 1)
            if rank == 0:
                logger.info("epoch %d val: %s", epoch + 1, {k: round(v, 4) for k, v in m.items()})
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
