"""BEVDet4D-lite: LSS view transform on the current keyframe + one previous sweep,
CenterPoint heatmap head, nuScenes detection eval on rank 0.

torchrun --nproc_per_node=8 07_bevdet4d_centerhead.py --work-dir /shared/exps/bevdet4d_r50
"""
import argparse
import datetime
import json
import os
import pickle

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from pyquaternion import Quaternion
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

CLASSES = ["car", "truck", "construction_vehicle", "bus", "trailer", "barrier",
           "motorcycle", "bicycle", "pedestrian", "traffic_cone"]
PC_RANGE = (-51.2, -51.2, -5.0, 51.2, 51.2, 3.0)
BEV_RES, BEV_SIZE, MAX_OBJS = 0.8, 128, 500
IMG_H, IMG_W = 256, 704


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-root", default="/shared/data/nuscenes")
    ap.add_argument("--work-dir", default="/shared/exps/bevdet4d_r50")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-4, help="per 32 samples")
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--fp16", action="store_true")
    return ap.parse_args()


def load_cams(data_root, cam_infos, mean, std):
    imgs, mats = [], []
    for c in cam_infos:
        img = Image.open(os.path.join(data_root, c["data_path"])).convert("RGB")
        sx, sy = IMG_W / img.width, IMG_H / img.height
        img = np.asarray(img.resize((IMG_W, IMG_H)), dtype=np.float32)
        imgs.append(torch.from_numpy((img - mean) / std).permute(2, 0, 1))
        K = np.asarray(c["cam_intrinsic"], dtype=np.float32).copy()
        K[0] *= sx
        K[1] *= sy
        cam2ego = np.asarray(c["cam2ego"], dtype=np.float32)
        mats.append(torch.from_numpy(np.concatenate([K.reshape(-1), cam2ego.reshape(-1)])))
    return torch.stack(imgs), torch.stack(mats)


class NuScenesDet4D(Dataset):
    def __init__(self, data_root, split):
        with open(os.path.join(data_root, f"bevdet4d_infos_{split}.pkl"), "rb") as f:
            self.infos = pickle.load(f)
        self.data_root = data_root
        self.mean = np.array([123.675, 116.28, 103.53], dtype=np.float32)
        self.std = np.array([58.395, 57.12, 57.375], dtype=np.float32)

    def __len__(self):
        return len(self.infos)

    def targets(self, boxes, labels):
        hm = np.zeros((len(CLASSES), BEV_SIZE, BEV_SIZE), dtype=np.float32)
        reg = np.zeros((MAX_OBJS, 10), dtype=np.float32)  # dx dy z log(lwh) sin cos vx vy
        ind = np.zeros(MAX_OBJS, dtype=np.int64)
        mask = np.zeros(MAX_OBJS, dtype=np.bool_)
        for k, (b, c) in enumerate(zip(boxes[:MAX_OBJS], labels[:MAX_OBJS])):
            x, y = (b[0] - PC_RANGE[0]) / BEV_RES, (b[1] - PC_RANGE[1]) / BEV_RES
            ix, iy = int(x), int(y)
            if not (0 <= ix < BEV_SIZE and 0 <= iy < BEV_SIZE):
                continue
            r = max(2, int(0.5 * max(b[3], b[4]) / BEV_RES))
            ys, xs = np.ogrid[-r:r + 1, -r:r + 1]
            g = np.exp(-(xs * xs + ys * ys) / (2 * (r / 3) ** 2))
            y0, y1, x0, x1 = max(0, iy - r), min(BEV_SIZE, iy + r + 1), max(0, ix - r), min(BEV_SIZE, ix + r + 1)
            hm[c, y0:y1, x0:x1] = np.maximum(hm[c, y0:y1, x0:x1],
                                             g[y0 - iy + r:y1 - iy + r, x0 - ix + r:x1 - ix + r])
            reg[k] = [x - ix, y - iy, b[2], *np.log(b[3:6]), np.sin(b[6]), np.cos(b[6]), b[7], b[8]]
            ind[k], mask[k] = iy * BEV_SIZE + ix, True
        return hm, reg, ind, mask

    def __getitem__(self, i):
        info = self.infos[i]
        cur_imgs, cur_mats = load_cams(self.data_root, info["cams"], self.mean, self.std)
        prev = info.get("prev_sweep") or info  # first keyframe of a scene reuses itself
        prev_imgs, prev_mats = load_cams(self.data_root, prev["cams"], self.mean, self.std)
        hm, reg, ind, mask = self.targets(np.asarray(info["gt_boxes"]), np.asarray(info["gt_labels"]))
        return {"imgs": torch.stack([cur_imgs, prev_imgs]), "mats": torch.stack([cur_mats, prev_mats]),
                "hm": torch.from_numpy(hm), "reg": torch.from_numpy(reg), "ind": torch.from_numpy(ind),
                "mask": torch.from_numpy(mask), "index": i}


class ImageBackbone(nn.Module):
    """ResNet-50 with frozen BN statistics and activation checkpointing per stage."""

    def __init__(self):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V2", norm_layer=torchvision.ops.FrozenBatchNorm2d)
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool)
        self.stages = nn.ModuleList([r.layer1, r.layer2, r.layer3])
        for p in self.stem.parameters():
            p.requires_grad = False

    def forward(self, x):
        x = self.stem(x)
        for stage in self.stages:
            x = checkpoint(stage, x, use_reentrant=False) if self.training else stage(x)
        return x  # stride 16, 1024 ch


class BEVDet4DLite(nn.Module):
    def __init__(self, C=80, D_bins=(1.0, 60.0, 1.0)):
        super().__init__()
        self.C = C
        self.backbone = ImageBackbone()
        self.D = len(np.arange(*D_bins))
        self.depthnet = nn.Sequential(nn.Conv2d(1024, 256, 3, padding=1, bias=False), nn.BatchNorm2d(256),
                                      nn.ReLU(inplace=True), nn.Conv2d(256, self.D + C, 1))
        fH, fW = IMG_H // 16, IMG_W // 16
        d = torch.arange(*D_bins).view(-1, 1, 1).expand(-1, fH, fW)
        u = torch.linspace(0, IMG_W - 1, fW).view(1, 1, -1).expand_as(d)
        v = torch.linspace(0, IMG_H - 1, fH).view(1, -1, 1).expand_as(d)
        self.register_buffer("frustum", torch.stack([u * d, v * d, d], -1).view(-1, 3), persistent=False)
        self.bev_encoder = nn.Sequential(
            nn.Conv2d(2 * C, 256, 3, padding=1, bias=False), nn.BatchNorm2d(256), nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, 3, padding=1, bias=False), nn.BatchNorm2d(256), nn.ReLU(inplace=True))
        self.hm_head = nn.Sequential(nn.Conv2d(256, 64, 3, padding=1), nn.ReLU(inplace=True),
                                     nn.Conv2d(64, len(CLASSES), 1))
        self.reg_head = nn.Sequential(nn.Conv2d(256, 64, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(64, 10, 1))
        nn.init.constant_(self.hm_head[-1].bias, -2.19)

    def frame_bev(self, imgs, mats):
        B, N = imgs.shape[:2]
        x = self.depthnet(self.backbone(imgs.flatten(0, 1)))
        feat = x[:, : self.D].softmax(1).unsqueeze(1) * x[:, self.D:].unsqueeze(2)
        feat = feat.view(B, N, self.C, -1).transpose(2, 3).reshape(-1, self.C)
        K = mats[..., :9].view(B, N, 3, 3)
        T = mats[..., 9:].view(B, N, 4, 4)
        pts = torch.einsum("bnij,pj->bnpi", torch.inverse(K), self.frustum)
        pts = torch.einsum("bnij,bnpj->bnpi", T[..., :3, :3], pts) + T[..., None, :3, 3]
        ij = ((pts[..., :2] - pts.new_tensor(PC_RANGE[:2])) / BEV_RES).long()
        b = torch.arange(B, device=pts.device).view(B, 1, 1).expand(pts.shape[:3]).reshape(-1)
        ij = ij.view(-1, 2)
        z = pts[..., 2].reshape(-1)
        ok = (ij >= 0).all(1) & (ij < BEV_SIZE).all(1) & (z > PC_RANGE[2]) & (z < PC_RANGE[5])
        flat = (b[ok] * BEV_SIZE + ij[ok, 1]) * BEV_SIZE + ij[ok, 0]
        bev = feat.new_zeros(B * BEV_SIZE * BEV_SIZE, self.C).index_add_(0, flat, feat[ok])
        return bev.view(B, BEV_SIZE, BEV_SIZE, self.C).permute(0, 3, 1, 2)

    def forward(self, imgs, mats):
        cur = self.frame_bev(imgs[:, 0], mats[:, 0])
        with torch.no_grad():
            prev = self.frame_bev(imgs[:, 1], mats[:, 1])
        x = self.bev_encoder(torch.cat([cur, prev], 1))
        return self.hm_head(x), self.reg_head(x)


def focal_loss(logits, gt, alpha=2, beta=4):
    pred = logits.float().sigmoid().clamp(1e-4, 1 - 1e-4)
    pos = gt.eq(1).float()
    neg = 1 - pos
    pos_loss = torch.log(pred) * (1 - pred) ** alpha * pos
    neg_loss = torch.log(1 - pred) * pred ** alpha * (1 - gt) ** beta * neg
    return -(pos_loss.sum() + neg_loss.sum()) / pos.sum().clamp(min=1)


def detection_loss(hm_pred, reg_pred, batch):
    B = hm_pred.shape[0]
    reg = reg_pred.float().flatten(2).transpose(1, 2)  # (B, HW, 10)
    reg = reg.gather(1, batch["ind"].unsqueeze(-1).expand(-1, -1, 10))
    m = batch["mask"].unsqueeze(-1).float()
    l1 = (F.l1_loss(reg * m, batch["reg"] * m, reduction="sum") / (m.sum() * 10).clamp(min=1))
    return focal_loss(hm_pred, batch["hm"]) + 0.25 * l1


@torch.no_grad()
def decode(hm_pred, reg_pred, topk=300):
    hm = hm_pred.float().sigmoid()
    keep = (F.max_pool2d(hm, 3, stride=1, padding=1) == hm).float()
    B, C, H, W = hm.shape
    scores, idx = (hm * keep).view(B, -1).topk(topk)
    cls, pix = idx // (H * W), idx % (H * W)
    reg = reg_pred.float().flatten(2).gather(2, pix.unsqueeze(1).expand(-1, 10, -1)).transpose(1, 2)
    x = ((pix % W).float() + reg[..., 0]) * BEV_RES + PC_RANGE[0]
    y = ((pix // W).float() + reg[..., 1]) * BEV_RES + PC_RANGE[1]
    yaw = torch.atan2(reg[..., 6], reg[..., 7])
    boxes = torch.cat([x[..., None], y[..., None], reg[..., 2:3], reg[..., 3:6].exp(), yaw[..., None], reg[..., 8:10]], -1)
    return boxes.cpu().numpy(), scores.cpu().numpy(), cls.cpu().numpy()


def to_nusc_results(info, boxes, scores, labels, thresh=0.05):
    ego_q, ego_t = Quaternion(info["ego2global_rotation"]), np.asarray(info["ego2global_translation"])
    out = []
    for b, s, c in zip(boxes, scores, labels):
        if s < thresh:
            continue
        center = ego_q.rotate(b[:3]) + ego_t
        rot = ego_q * Quaternion(axis=[0, 0, 1], radians=float(b[6]))
        vel = ego_q.rotate(np.array([b[7], b[8], 0.0]))[:2]
        out.append({"sample_token": info["token"], "translation": center.tolist(), "size": [b[4], b[3], b[5]],
                    "rotation": rot.elements.tolist(), "velocity": vel.tolist(), "detection_name": CLASSES[c],
                    "detection_score": float(s), "attribute_name": ""})
    return out


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # rank 0 runs the devkit evaluation (several minutes) while the others wait in barrier()
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_set, val_set = NuScenesDet4D(args.data_root, "train"), NuScenesDet4D(args.data_root, "val")
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, args.batch_size, sampler=val_sampler, num_workers=args.workers)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(BEVDet4DLite()).to(device)
    model = DDP(net, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 32
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.MultiStepLR(optim, [16 * len(train_loader), 19 * len(train_loader)], 0.1)
    scaler = torch.cuda.amp.GradScaler(enabled=args.fp16)

    start = 0
    if args.resume:
        ck = torch.load(args.resume, map_location=device)
        net.load_state_dict(ck["model"])
        optim.load_state_dict(ck["optim"])
        sched.load_state_dict(ck["sched"])
        scaler.load_state_dict(ck["scaler"])
        start = ck["epoch"] + 1

    tb = SummaryWriter(os.path.join(args.work_dir, "tf_logs")) if rank == 0 else None
    step = start * len(train_loader)
    for epoch in range(start, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
                hm, reg = model(batch["imgs"], batch["mats"])
            loss = detection_loss(hm, reg, batch)
            optim.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optim)
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optim)
            scaler.update()
            sched.step()
            step += 1
            if step % 50 == 0:
                avg = loss.detach().clone()
                dist.all_reduce(avg, op=dist.ReduceOp.AVG)
                if tb is not None:
                    tb.add_scalar("loss", avg.item(), step)

        if rank == 0:
            torch.save({"model": net.state_dict(), "optim": optim.state_dict(), "sched": sched.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch},
                       os.path.join(args.work_dir, f"epoch_{epoch + 1}.pth"))

        net.eval()
        local = {}
        with torch.no_grad():
            for batch in val_loader:
                hm, reg = net(batch["imgs"].to(device), batch["mats"].to(device))
                for i, (bx, sc, lb) in zip(batch["index"].tolist(), zip(*decode(hm, reg))):
                    local[i] = to_nusc_results(val_set.infos[i], bx, sc, lb)
        parts = [None] * world
        dist.all_gather_object(parts, local)
        if rank == 0:
            merged = {}
            for p in parts:
                merged.update(p)  # drops the duplicates DistributedSampler pads with
            results = {val_set.infos[i]["token"]: dets for i, dets in merged.items()}
            res_path = os.path.join(args.work_dir, f"results_ep{epoch + 1}.json")
            with open(res_path, "w") as f:
                json.dump({"meta": {"use_camera": True, "use_lidar": False}, "results": results}, f)
            from nuscenes import NuScenes
            from nuscenes.eval.detection.config import config_factory
            from nuscenes.eval.detection.evaluate import NuScenesEval
            nusc = NuScenes("v1.0-trainval", args.data_root, verbose=False)
            ev = NuScenesEval(nusc, config_factory("detection_cvpr_2019"), res_path, "val",
                              os.path.join(args.work_dir, f"eval_ep{epoch + 1}"), verbose=False)
            summary = ev.main(render_curves=False)
            tb.add_scalar("val/mAP", summary["mean_ap"], epoch)
            tb.add_scalar("val/NDS", summary["nd_score"], epoch)
            print(f"epoch {epoch + 1}: mAP {summary['mean_ap']:.4f} NDS {summary['nd_score']:.4f}", flush=True)
        dist.barrier()

    if tb is not None:
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
