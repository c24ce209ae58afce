# PointPillars on KITTI (3 classes), distributed training.
#
#   torchrun --nproc_per_node=8 train_pointpillars.py --cfg configs/pp_kitti_3class.yaml
#
import argparse
import logging
import os
import pickle
import time

import numpy as np
import yaml
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from mmcv.ops import Voxelization
from av3d.anchor import AnchorGenerator3D, assign_anchor_targets, DeltaXYZWLHRBBoxCoder
from av3d.postprocess import nms_bev
from av3d.eval.kitti import kitti_eval

DEFAULT_CFG = dict(
    classes=["Car", "Pedestrian", "Cyclist"],
    point_cloud_range=[0, -39.68, -3, 69.12, 39.68, 1],
    voxel_size=[0.16, 0.16, 4],
    max_points=32,
    max_voxels=(16000, 40000),
    samples_per_gpu=2,
    workers_per_gpu=4,
    lr=0.001,  # 8 GPUs x 2 samples
    epochs=80,
    weight_decay=0.01,
)

log = logging.getLogger(__name__)


class KittiPointDataset(Dataset):
    def __init__(self, root, split, classes, pc_range, training):
        with open(os.path.join(root, f"kitti_infos_{split}.pkl"), "rb") as f:
            self.infos = pickle.load(f)
        self.root = root
        self.classes = classes
        self.pc_range = np.array(pc_range, dtype=np.float32)
        self.training = training

    def __len__(self):
        return len(self.infos)

    def __getitem__(self, i):
        info = self.infos[i]
        pts = np.fromfile(os.path.join(self.root, info["velodyne_reduced_path"]), np.float32).reshape(-1, 4)
        ann = info["annos"]
        keep = np.isin(ann["name"], self.classes)
        boxes = ann["gt_boxes_lidar"][keep].astype(np.float32)
        labels = np.array([self.classes.index(n) for n in ann["name"][keep]], np.int64)
        if self.training:
            if np.random.rand() < 0.5:
                pts[:, 1] *= -1
                boxes[:, 1] *= -1
                boxes[:, 6] *= -1
            rot = np.random.uniform(-np.pi / 4, np.pi / 4)
            c, s = np.cos(rot), np.sin(rot)
            R = np.array([[c, -s], [s, c]], np.float32)
            pts[:, :2] = pts[:, :2] @ R.T
            boxes[:, :2] = boxes[:, :2] @ R.T
            boxes[:, 6] += rot
            sc = np.random.uniform(0.95, 1.05)
            pts[:, :3] *= sc
            boxes[:, :6] *= sc
        r = self.pc_range
        m = (pts[:, 0] >= r[0]) & (pts[:, 0] < r[3]) & (pts[:, 1] >= r[1]) & (pts[:, 1] < r[4])
        return dict(points=torch.from_numpy(pts[m]), boxes=torch.from_numpy(boxes),
                    labels=torch.from_numpy(labels), idx=info["image"]["image_idx"])


def collate(batch):
    pts = torch.cat([F.pad(b["points"], (1, 0), value=i) for i, b in enumerate(batch)])
    return dict(points=pts, boxes=[b["boxes"] for b in batch], labels=[b["labels"] for b in batch],
                idx=[b["idx"] for b in batch])


class PillarVFE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.vs = cfg["voxel_size"]
        self.pcr = cfg["point_cloud_range"]
        self.nx = int(round((self.pcr[3] - self.pcr[0]) / self.vs[0]))
        self.ny = int(round((self.pcr[4] - self.pcr[1]) / self.vs[1]))
        self.vox = Voxelization(self.vs, self.pcr, cfg["max_points"], cfg["max_voxels"])
        self.pfn = nn.Linear(9, 64, bias=False)
        self.bn = nn.BatchNorm1d(64, eps=1e-3, momentum=0.01)

    def forward(self, points, bs):
        out = []
        for b in range(bs):
            v, c, n = self.vox(points[points[:, 0] == b, 1:].contiguous())
            valid = (torch.arange(v.shape[1], device=v.device)[None] < n[:, None]).unsqueeze(-1)
            mean = v[..., :3].sum(1, keepdim=True) / n.clamp(min=1).view(-1, 1, 1)
            xc = c[:, 2:3].float() * self.vs[0] + self.vs[0] / 2 + self.pcr[0]
            yc = c[:, 1:2].float() * self.vs[1] + self.vs[1] / 2 + self.pcr[1]
            f = torch.cat([v, v[..., :3] - mean, (v[..., 0] - xc).unsqueeze(-1),
                           (v[..., 1] - yc).unsqueeze(-1)], -1) * valid
            f = F.relu(self.bn(self.pfn(f).transpose(1, 2)).transpose(1, 2)).max(1)[0]
            canvas = f.new_zeros(64, self.ny * self.nx)
            canvas[:, c[:, 1] * self.nx + c[:, 2]] = f.t()
            out.append(canvas.view(64, self.ny, self.nx))
        return torch.stack(out)


def block(cin, cout, n, stride):
    layers = [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout, eps=1e-3, momentum=0.01), nn.ReLU()]
    for _ in range(n):
        layers += [nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout, eps=1e-3, momentum=0.01), nn.ReLU()]
    return nn.Sequential(*layers)


def deblock(cin, cout, stride):
    return nn.Sequential(nn.ConvTranspose2d(cin, cout, stride, stride, bias=False),
                         nn.BatchNorm2d(cout, eps=1e-3, momentum=0.01), nn.ReLU())


class PointPillars(nn.Module):
    def __init__(self, cfg, num_anchors=6, num_classes=3):
        super().__init__()
        self.vfe = PillarVFE(cfg)
        self.b1, self.b2, self.b3 = block(64, 64, 3, 2), block(64, 128, 5, 2), block(128, 256, 5, 2)
        self.d1, self.d2, self.d3 = deblock(64, 128, 1), deblock(128, 128, 2), deblock(256, 128, 4)
        self.cls = nn.Conv2d(384, num_anchors * num_classes, 1)
        self.reg = nn.Conv2d(384, num_anchors * 7, 1)
        self.dir = nn.Conv2d(384, num_anchors * 2, 1)
        nn.init.constant_(self.cls.bias, -4.595)

    def forward(self, points, bs):
        x = self.vfe(points, bs)
        x1 = self.b1(x)
        x2 = self.b2(x1)
        x3 = self.b3(x2)
        x = torch.cat([self.d1(x1), self.d2(x2), self.d3(x3)], 1)
        return self.cls(x), self.reg(x), self.dir(x)


def sigmoid_focal(logits, targets, alpha=0.25, gamma=2.0):
    p = logits.sigmoid()
    ce = F.binary_cross_entropy_with_logits(logits, targets, reduction="none")
    pt = p * targets + (1 - p) * (1 - targets)
    return ce * ((1 - pt) ** gamma) * (alpha * targets + (1 - alpha) * (1 - targets))


def compute_loss(preds, targets, num_classes):
    cls, reg, dirc = preds
    B = cls.shape[0]
    cls = cls.permute(0, 2, 3, 1).reshape(B, -1, num_classes)
    reg = reg.permute(0, 2, 3, 1).reshape(B, -1, 7)
    dirc = dirc.permute(0, 2, 3, 1).reshape(B, -1, 2)
    labels, reg_t, dir_t, weights = targets
    pos = (labels >= 0) & (labels < num_classes)
    num_pos = pos.sum().clamp(min=1).float()
    onehot = F.one_hot(labels.clamp(min=0, max=num_classes), num_classes + 1)[..., :num_classes].float()
    l_cls = (sigmoid_focal(cls, onehot) * weights[..., None]).sum() / num_pos
    l_reg = F.smooth_l1_loss(reg[pos], reg_t[pos], beta=1 / 9, reduction="sum") / num_pos
    l_dir = F.cross_entropy(dirc[pos], dir_t[pos], reduction="sum") / num_pos
    return l_cls + 2.0 * l_reg + 0.2 * l_dir


@torch.no_grad()
def run_eval(model, loader, anchors, coder, cfg, root):
    model.eval()
    dets = {}
    for batch in loader:
        cls, reg, _ = model(batch["points"].cuda(non_blocking=True), len(batch["idx"]))
        B = cls.shape[0]
        scores = cls.permute(0, 2, 3, 1).reshape(B, -1, 3).sigmoid()
        deltas = reg.permute(0, 2, 3, 1).reshape(B, -1, 7)
        for b in range(B):
            boxes = coder.decode(anchors, deltas[b])
            s, lab = scores[b].max(-1)
            keep = nms_bev(boxes, s, iou_thr=0.01, score_thr=0.1, max_num=50)
            dets[batch["idx"][b]] = dict(boxes=boxes[keep].cpu().numpy(), scores=s[keep].cpu().numpy(),
                                         labels=lab[keep].cpu().numpy())
    parts = [None for _ in range(dist.get_world_size())]
    dist.all_gather_object(parts, dets)
    model.train()
    if dist.get_rank() != 0:
        return None
    merged = {k: v for p in parts for k, v in p.items()}
    return kitti_eval(merged, os.path.join(root, "kitti_infos_val.pkl"), cfg["classes"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    ap.add_argument("--root", default="data/kitti")
    ap.add_argument("--out", default="work_dirs/pp_kitti")
    args = ap.parse_args()
    cfg = dict(DEFAULT_CFG)
    if args.cfg:
        with open(args.cfg) as f:
            cfg.update(yaml.safe_load(f))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR)
    writer = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None

    train_ds = KittiPointDataset(args.root, "train", cfg["classes"], cfg["point_cloud_range"], True)
    val_ds = KittiPointDataset(args.root, "val", cfg["classes"], cfg["point_cloud_range"], False)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, cfg["samples_per_gpu"], sampler=train_sampler, collate_fn=collate,
                          num_workers=cfg["workers_per_gpu"], pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, cfg["samples_per_gpu"], sampler=DistributedSampler(val_ds, shuffle=False),
                        collate_fn=collate, num_workers=cfg["workers_per_gpu"])

    model = PointPillars(cfg).cuda()
    model = DDP(model, device_ids=[local_rank])

    anchor_gen = AnchorGenerator3D(cfg["point_cloud_range"], sizes=[[3.9, 1.6, 1.56], [0.8, 0.6, 1.73], [1.76, 0.6, 1.73]],
                                   rotations=[0, 1.57], feature_size=(248, 216))
    anchors = anchor_gen.anchors().cuda()
    coder = DeltaXYZWLHRBBoxCoder()

    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    total = cfg["epochs"] * len(train_dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, cfg["lr"], total_steps=total, pct_start=0.4)

    step = 0
    for epoch in range(cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for batch in train_dl:
            pts = batch["points"].cuda(non_blocking=True)
            preds = model(pts, len(batch["idx"]))
            targets = assign_anchor_targets(anchors, [b.cuda() for b in batch["boxes"]],
                                            [l.cuda() for l in batch["labels"]], coder,
                                            pos_iou=[0.6, 0.5, 0.5], neg_iou=[0.45, 0.35, 0.35])
            loss = compute_loss(preds, targets, num_classes=3)
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            sched.step()
            step += 1
            if writer is not None and step % 20 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/lr", sched.get_last_lr()[0], step)
        if rank == 0:
            log.info("epoch %d done in %.1fs, loss %.4f", epoch, time.time() - tic, loss.item())
            os.makedirs(args.out, exist_ok=True)
            torch.save({"state_dict": model.module.state_dict(), "epoch": epoch},
                       os.path.join(args.out, f"epoch_{epoch + 1}.pth"))
        if (epoch + 1) % 10 == 0:
            res = run_eval(model, val_dl, anchors, coder, cfg, args.root)
            if rank == 0:
                for k, v in res.items():
                    writer.add_scalar(f"val/{k}", v, epoch + 1)
                log.info("eval epoch %d: %s", epoch + 1, res)
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
