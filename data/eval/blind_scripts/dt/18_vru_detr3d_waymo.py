"""Query-based lidar detector for vulnerable road users (pedestrian / cyclist) on Waymo.

Point features from a pillar encoder, a BEV CNN, then a DETR-style decoder with
Hungarian matching. Only PEDESTRIAN and CYCLIST labels are kept.

    torchrun --nproc_per_node=8 train_vru_detr.py --data /data/waymo_v1_4/processed --work-dir exps/vru_detr_3sw
"""
import argparse
import logging
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from scipy.optimize import linear_sum_assignment
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.ops import sigmoid_focal_loss

from av3d.models.lidar import DynamicPillarEncoder
from av3d.eval.waymo import waymo_let_metrics

CLASSES = ["Pedestrian", "Cyclist"]
PC_RANGE = [-74.88, -74.88, -2.0, 74.88, 74.88, 4.0]
logger = logging.getLogger("vru")


class WaymoVRU(Dataset):
    def __init__(self, root, split, sweeps=3, training=True, interval=1):
        with open(os.path.join(root, f"waymo_infos_{split}.pkl"), "rb") as f:
            self.infos = pickle.load(f)[::interval]
        self.root, self.sweeps, self.training = root, sweeps, training

    def __len__(self):
        return len(self.infos)

    def __getitem__(self, i):
        info = self.infos[i]
        clouds = []
        for k, sw in enumerate([info] + info["sweeps"][: self.sweeps - 1]):
            p = np.load(os.path.join(self.root, sw["lidar_path"]))[:, :4].astype(np.float32)
            if k > 0:
                T = np.linalg.inv(info["pose"]) @ sw["pose"]
                p[:, :3] = p[:, :3] @ T[:3, :3].T + T[:3, 3]
            p[:, 3] = np.tanh(p[:, 3])
            clouds.append(np.concatenate([p, np.full((len(p), 1), 0.1 * k, np.float32)], 1))
        pts = np.concatenate(clouds)
        a = info["annos"]
        keep = np.isin(a["name"], CLASSES) & (a["num_points_in_gt"] > 0)
        boxes = a["gt_boxes_lidar"][keep][:, :7].astype(np.float32)
        labels = np.array([CLASSES.index(n) for n in a["name"][keep]], np.int64)
        if self.training:
            if np.random.rand() < 0.5:
                pts[:, 1], boxes[:, 1], boxes[:, 6] = -pts[:, 1], -boxes[:, 1], -boxes[:, 6]
            s = np.random.uniform(0.95, 1.05)
            pts[:, :3] *= s
            boxes[:, :6] *= s
        m = ((pts[:, 0] > PC_RANGE[0]) & (pts[:, 0] < PC_RANGE[3]) & (pts[:, 1] > PC_RANGE[1]) &
             (pts[:, 1] < PC_RANGE[4]) & (pts[:, 2] > PC_RANGE[2]) & (pts[:, 2] < PC_RANGE[5]))
        return torch.from_numpy(pts[m]), torch.from_numpy(boxes), torch.from_numpy(labels), info["frame_id"]


def collate(batch):
    pts, boxes, labels, ids = zip(*batch)
    return list(pts), list(boxes), list(labels), list(ids)


class VRUDetr(nn.Module):
    def __init__(self, d=256, num_queries=300, num_classes=len(CLASSES)):
        super().__init__()
        self.encoder = DynamicPillarEncoder(in_channels=5, out_channels=64, voxel_size=[0.32, 0.32, 6.0],
                                            point_cloud_range=PC_RANGE)  # -> B, 64, 468, 468
        chans = [64, 128, 256]
        self.stages = nn.ModuleList()
        cin = 64
        for c in chans:
            self.stages.append(nn.Sequential(nn.Conv2d(cin, c, 3, 2, 1, bias=False), nn.GroupNorm(32, c), nn.GELU(),
                                             nn.Conv2d(c, c, 3, 1, 1, bias=False), nn.GroupNorm(32, c), nn.GELU()))
            cin = c
        self.proj = nn.Conv2d(256, d, 1)
        self.pos = nn.Parameter(torch.randn(1, d, 59, 59) * 0.02)
        self.query = nn.Embedding(num_queries, d)
        layer = nn.TransformerDecoderLayer(d, 8, 1024, dropout=0.1, batch_first=True, norm_first=True)
        self.decoder = nn.TransformerDecoder(layer, num_layers=6)
        self.cls_head = nn.Linear(d, num_classes)
        self.box_head = nn.Sequential(nn.Linear(d, d), nn.ReLU(True), nn.Linear(d, 8))  # xyz, log lwh, sin, cos

    def forward(self, points):
        x = self.encoder(points)
        for s in self.stages:
            x = s(x)
        x = self.proj(x) + self.pos
        mem = x.flatten(2).transpose(1, 2)
        q = self.query.weight[None].expand(x.shape[0], -1, -1)
        h = self.decoder(q, mem)
        return self.cls_head(h), self.box_head(h)


def encode_boxes(b):
    return torch.cat([b[:, :3], b[:, 3:6].clamp(min=1e-2).log(), torch.sin(b[:, 6:7]), torch.cos(b[:, 6:7])], 1)


def decode_boxes(e):
    return torch.cat([e[..., :3], e[..., 3:6].exp(), torch.atan2(e[..., 6:7], e[..., 7:8])], -1)


def hungarian_loss(logits, boxes_pred, gt_boxes, gt_labels):
    B, Q, C = logits.shape
    cls_loss, reg_loss, npos = 0.0, 0.0, 0
    for b in range(B):
        tgt = torch.zeros(Q, C, device=logits.device)
        if len(gt_boxes[b]):
            enc = encode_boxes(gt_boxes[b])
            cost = torch.cdist(boxes_pred[b, :, :3], enc[:, :3], p=1) - logits[b].sigmoid()[:, gt_labels[b]] * 2.0
            qi, gi = linear_sum_assignment(cost.detach().cpu().numpy())
            qi, gi = torch.as_tensor(qi, device=logits.device), torch.as_tensor(gi, device=logits.device)
            tgt[qi, gt_labels[b][gi]] = 1.0
            reg_loss = reg_loss + F.l1_loss(boxes_pred[b, qi], enc[gi], reduction="sum")
            npos += len(gi)
        cls_loss = cls_loss + sigmoid_focal_loss(logits[b], tgt, alpha=0.25, gamma=2.0, reduction="sum")
    npos = max(npos, 1)
    return cls_loss / npos, reg_loss / npos


@torch.no_grad()
def evaluate(model, loader, dataset):
    model.eval()
    preds = {}
    for pts, _, _, ids in loader:
        logits, boxes = model([p.cuda(non_blocking=True) for p in pts])
        scores, labels = logits.sigmoid().max(-1)
        for i, fid in enumerate(ids):
            keep = scores[i] > 0.1
            preds[fid] = {"boxes": decode_boxes(boxes[i][keep]).cpu().numpy(),
                          "scores": scores[i][keep].cpu().numpy(), "labels": labels[i][keep].cpu().numpy()}
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, preds)
    model.train()
    if dist.get_rank() == 0:
        merged = {k: v for o in out for k, v in o.items()}
        return waymo_let_metrics(merged, dataset.infos, CLASSES)
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("--epochs", type=int, default=24)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--sweeps", type=int, default=3)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)

    train_ds = WaymoVRU(args.data, "train", args.sweeps, training=True, interval=5)
    val_ds = WaymoVRU(args.data, "val", args.sweeps, training=False, interval=5)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8, collate_fn=collate,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size, sampler=DistributedSampler(val_ds, shuffle=False),
                        num_workers=8, collate_fn=collate)

    model = DDP(VRUDetr().cuda(), device_ids=[local_rank])
    decay = [p for n, p in model.named_parameters() if p.ndim > 1 and "pos" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1 or "pos" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(train_dl),
                                                pct_start=0.1)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, n_skipped = time.time(), 0
        for it, (pts, boxes, labels, _) in enumerate(train_dl):
            if sum(len(b) for b in boxes) == 0:
                n_skipped += 1
                continue
            logits, box_pred = model([p.cuda(non_blocking=True) for p in pts])
            l_cls, l_reg = hungarian_loss(logits.float(), box_pred.float(), [b.cuda() for b in boxes],
                                          [l.cuda() for l in labels])
            loss = l_cls + 0.25 * l_reg
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            opt.step()
            sched.step()
            if rank == 0 and it % 100 == 0:
                logger.info("ep %d it %d/%d cls %.4f reg %.4f skipped %d %.2fs/it", epoch, it, len(train_dl),
                            l_cls.item(), l_reg.item(), n_skipped, (time.time() - t0) / (it + 1))
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.work_dir, "latest.pth"))
        if (epoch + 1) % 4 == 0:
            m = evaluate(model, val_dl, val_ds)
            if rank == 0:
                logger.info("epoch %d: %s", epoch + 1, m)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
