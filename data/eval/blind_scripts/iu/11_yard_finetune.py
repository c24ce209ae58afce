"""Fine-tune a pillar center detector on the depot / yard LiDAR set (Ouster OS1-128, 4 classes).

Starts from a checkpoint of an earlier run of this script (e.g. pre-trained on the public
split with other classes); layers whose shapes differ (class heads) are re-initialised.

    torchrun --nproc_per_node=4 11_yard_finetune.py --data-root /data/yard_lidar \
        --pretrained runs/pretrain_public/last.pth --epochs 24
"""
import argparse
import json
import logging
import math
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from yardlib.metrics import center_distance_ap


@dataclass
class Cfg:
    classes: tuple = ("truck", "trailer", "person", "forklift")
    pc_range: tuple = (-60.0, -60.0, -3.0, 60.0, 60.0, 5.0)
    voxel: tuple = (0.2, 0.2, 8.0)
    max_pts: int = 32
    max_pillars: int = 30000
    stride: int = 2
    max_objs: int = 200


C = Cfg()
NX = int(round((C.pc_range[3] - C.pc_range[0]) / C.voxel[0]))
NY = int(round((C.pc_range[4] - C.pc_range[1]) / C.voxel[1]))
log = logging.getLogger("finetune")


def pillarize(pts):
    lo = np.array(C.pc_range[:2], np.float32)
    ij = ((pts[:, :2] - lo) / np.array(C.voxel[:2], np.float32)).astype(np.int64)
    key = ij[:, 1] * NX + ij[:, 0]
    order = np.argsort(key, kind="stable")
    pts, ij, key = pts[order], ij[order], key[order]
    _, first, cnt = np.unique(key, return_index=True, return_counts=True)
    slot = np.arange(len(key)) - np.repeat(first, cnt)
    ok = slot < C.max_pts
    pil = np.zeros((len(first), C.max_pts, pts.shape[1]), np.float32)
    pil[np.repeat(np.arange(len(first)), cnt)[ok], slot[ok]] = pts[ok]
    num, yx = np.minimum(cnt, C.max_pts).astype(np.int32), ij[first][:, ::-1].astype(np.int64)
    if len(first) > C.max_pillars:
        sel = np.random.choice(len(first), C.max_pillars, replace=False)
        pil, num, yx = pil[sel], num[sel], yx[sel]
    return pil, yx, num


def make_targets(boxes, labels):
    H, W = NY // C.stride, NX // C.stride
    hm = np.zeros((len(C.classes), H, W), np.float32)
    reg = np.zeros((C.max_objs, 8), np.float32)
    ind, mask = np.zeros(C.max_objs, np.int64), np.zeros(C.max_objs, np.float32)
    for k, (b, c) in enumerate(zip(boxes[:C.max_objs], labels)):
        fx = (b[0] - C.pc_range[0]) / C.voxel[0] / C.stride
        fy = (b[1] - C.pc_range[1]) / C.voxel[1] / C.stride
        cx, cy = int(fx), int(fy)
        if not (0 <= cx < W and 0 <= cy < H):
            continue
        r = max(2, int(0.3 * math.hypot(b[3], b[4]) / C.voxel[0] / C.stride))
        yy, xx = np.ogrid[-r:r + 1, -r:r + 1]
        g = np.exp(-(xx * xx + yy * yy) / (2 * ((2 * r + 1) / 6) ** 2))
        x0, x1, y0, y1 = max(cx - r, 0), min(cx + r + 1, W), max(cy - r, 0), min(cy + r + 1, H)
        hm[c, y0:y1, x0:x1] = np.maximum(hm[c, y0:y1, x0:x1], g[y0 - cy + r:y1 - cy + r, x0 - cx + r:x1 - cx + r])
        ind[k], mask[k] = cy * W + cx, 1
        reg[k] = [fx - cx, fy - cy, b[2], *np.log(b[3:6]), math.sin(b[6]), math.cos(b[6])]
    return hm, reg, ind, mask


class YardScans(Dataset):
    """split file: one scan id per line; scans/<id>.npy (N, 4) and labels/<id>.json."""

    def __init__(self, root, split, train):
        self.root, self.train = root, train
        with open(os.path.join(root, "splits", f"{split}.txt")) as f:
            self.ids = [l.strip() for l in f if l.strip()]

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        sid = self.ids[i]
        pts = np.load(os.path.join(self.root, "scans", f"{sid}.npy")).astype(np.float32)
        pts[:, 3] = np.clip(pts[:, 3] / 1000.0, 0, 1)  # raw Ouster reflectivity
        with open(os.path.join(self.root, "labels", f"{sid}.json")) as f:
            objs = [o for o in json.load(f) if o["label"] in C.classes]
        boxes = np.array([o["box"] for o in objs], np.float32).reshape(-1, 7)
        labels = np.array([C.classes.index(o["label"]) for o in objs], np.int64)
        if self.train:
            if np.random.rand() < 0.5:
                pts[:, 1], boxes[:, 1], boxes[:, 6] = -pts[:, 1], -boxes[:, 1], -boxes[:, 6]
            a = np.random.uniform(-np.pi, np.pi)
            R = np.array([[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]], np.float32)
            pts[:, :2], boxes[:, :2], boxes[:, 6] = pts[:, :2] @ R.T, boxes[:, :2] @ R.T, boxes[:, 6] + a
        lo, hi = np.array(C.pc_range[:3]), np.array(C.pc_range[3:])
        pts = pts[np.all((pts[:, :3] >= lo) & (pts[:, :3] < hi), 1)]
        inr = np.all((boxes[:, :2] >= lo[:2]) & (boxes[:, :2] < hi[:2]), 1)
        boxes, labels = boxes[inr], labels[inr]
        pil, yx, num = pillarize(pts)
        hm, reg, ind, mask = make_targets(boxes, labels)
        return dict(pillars=pil, coords=yx, num=num, hm=hm, reg=reg, ind=ind, mask=mask, sid=sid, gt=(boxes, labels))


def collate(batch):
    out = {k: torch.from_numpy(np.stack([b[k] for b in batch])) for k in ("hm", "reg", "ind", "mask")}
    out["pillars"] = torch.from_numpy(np.concatenate([b["pillars"] for b in batch]))
    out["num"] = torch.from_numpy(np.concatenate([b["num"] for b in batch]))
    out["coords"] = torch.from_numpy(np.concatenate([np.pad(b["coords"], ((0, 0), (1, 0)), constant_values=i)
                                                     for i, b in enumerate(batch)]))
    out.update(batch_size=len(batch), sids=[b["sid"] for b in batch], gt=[b["gt"] for b in batch])
    return out


def cbr(cin, cout, s=1):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, s, 1, bias=False), nn.BatchNorm2d(cout, eps=1e-3, momentum=0.01), nn.ReLU(True))


class PillarCenterNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("vsize", torch.tensor(C.voxel[:2]))
        self.register_buffer("origin", torch.tensor(C.pc_range[:2]))
        self.pfn = nn.Linear(9, 64, bias=False)
        self.pfn_bn = nn.BatchNorm1d(64, eps=1e-3, momentum=0.01)
        self.b1 = nn.Sequential(cbr(64, 64, 2), *[cbr(64, 64) for _ in range(3)])
        self.b2 = nn.Sequential(cbr(64, 128, 2), *[cbr(128, 128) for _ in range(5)])
        self.b3 = nn.Sequential(cbr(128, 256, 2), *[cbr(256, 256) for _ in range(5)])
        self.u1 = nn.Sequential(nn.Conv2d(64, 128, 1, bias=False), nn.BatchNorm2d(128), nn.ReLU(True))
        self.u2 = nn.Sequential(nn.ConvTranspose2d(128, 128, 2, 2, bias=False), nn.BatchNorm2d(128), nn.ReLU(True))
        self.u3 = nn.Sequential(nn.ConvTranspose2d(256, 128, 4, 4, bias=False), nn.BatchNorm2d(128), nn.ReLU(True))
        self.hm = nn.Sequential(cbr(384, 64), nn.Conv2d(64, len(C.classes), 1))
        self.reg = nn.Sequential(cbr(384, 64), nn.Conv2d(64, 8, 1))
        self.hm[-1].bias.data.fill_(-2.19)

    def forward(self, pillars, coords, num, batch_size):
        valid = (torch.arange(pillars.shape[1], device=pillars.device)[None] < num[:, None]).unsqueeze(-1)
        mean = pillars[..., :3].sum(1, keepdim=True) / num.clamp(min=1).view(-1, 1, 1)
        ctr = coords[:, [2, 1]].float() * self.vsize + self.vsize / 2 + self.origin
        f = torch.cat([pillars, pillars[..., :3] - mean, pillars[..., :2] - ctr[:, None]], -1) * valid
        f = F.relu(self.pfn_bn(self.pfn(f).transpose(1, 2))).max(-1)[0]
        bev = f.new_zeros(batch_size, 64, NY * NX)
        bev[coords[:, 0], :, coords[:, 1] * NX + coords[:, 2]] = f
        x1 = self.b1(bev.view(batch_size, 64, NY, NX))
        x2 = self.b2(x1)
        x3 = self.b3(x2)
        x = torch.cat([self.u1(x1), self.u2(x2), self.u3(x3)], 1)
        return self.hm(x), self.reg(x)


def loss_fn(hm_logit, reg_map, batch):
    p = hm_logit.sigmoid().clamp(1e-4, 1 - 1e-4)
    gt = batch["hm"]
    pos = gt.eq(1).float()
    l_hm = -(torch.log(p) * (1 - p) ** 2 * pos + torch.log(1 - p) * p ** 2 * (1 - gt) ** 4 * (1 - pos)).sum()
    l_hm = l_hm / pos.sum().clamp(min=1)
    ind = batch["ind"]
    pr = reg_map.flatten(2).gather(2, ind.unsqueeze(1).expand(-1, 8, -1)).transpose(1, 2)
    m = batch["mask"].unsqueeze(-1)
    l_reg = F.l1_loss(pr * m, batch["reg"] * m, reduction="sum") / (m.sum() * 8).clamp(min=1)
    return l_hm, l_reg


@torch.no_grad()
def decode(hm_logit, reg_map, k=100, thr=0.15):
    B, Cn, H, W = hm_logit.shape
    heat = hm_logit.sigmoid()
    heat = heat * (F.max_pool2d(heat, 3, 1, 1) == heat)
    scores, idx = heat.flatten(1).topk(k)
    cls, pix = idx // (H * W), idx % (H * W)
    r = reg_map.flatten(2).gather(2, pix.unsqueeze(1).expand(-1, 8, -1)).transpose(1, 2)
    x = ((pix % W).float() + r[..., 0]) * C.stride * C.voxel[0] + C.pc_range[0]
    y = ((pix // W).float() + r[..., 1]) * C.stride * C.voxel[1] + C.pc_range[1]
    boxes = torch.cat([x[..., None], y[..., None], r[..., 2:3], r[..., 3:6].exp(), torch.atan2(r[..., 6:7], r[..., 7:8])], -1)
    keep = scores > thr
    return [(boxes[b][keep[b]].cpu().numpy(), scores[b][keep[b]].cpu().numpy(), cls[b][keep[b]].cpu().numpy())
            for b in range(B)]


def load_pretrained(model, path):
    ckpt = torch.load(path, map_location="cpu")
    own = model.state_dict()
    # class heads differ from the pre-training run, keep only tensors whose shape matches
    matched = {k: v for k, v in ckpt["model"].items() if k in own and own[k].shape == v.shape}
    model.load_state_dict(matched, strict=False)
    return len(matched), len(own)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-root", default="/data/yard_lidar")
    ap.add_argument("--pretrained", default=None)
    ap.add_argument("--out", default="runs/yard_finetune")
    ap.add_argument("--epochs", type=int, default=24)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--workers", type=int, default=6)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    np.random.seed(100 + rank)

    train_set, val_set = YardScans(args.data_root, "train", True), YardScans(args.data_root, "val", False)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, args.bs, sampler=sampler, num_workers=args.workers, collate_fn=collate,
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, args.bs, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=args.workers, collate_fn=collate)

    net = PillarCenterNet()
    if args.pretrained:
        n, total = load_pretrained(net, args.pretrained)
        log.info("initialised %d / %d tensors from %s", n, total, args.pretrained)
    model = DDP(nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader), eta_min=args.lr * 0.01)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, batch in enumerate(loader):
            batch = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
            l_hm, l_reg = loss_fn(*model(batch["pillars"], batch["coords"], batch["num"], batch["batch_size"]), batch)
            opt.zero_grad(set_to_none=True)
            (l_hm + 0.25 * l_reg).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 35)
            opt.step()
            sched.step()
            if it % 50 == 0:
                s = torch.stack([l_hm.detach(), l_reg.detach()])
                dist.all_reduce(s, op=dist.ReduceOp.AVG)
                log.info("ep %d it %d/%d hm %.4f reg %.4f %.2fs/it", epoch, it, len(loader), s[0], s[1],
                         (time.time() - t0) / (it + 1))

        if (epoch + 1) % 4 == 0 or epoch + 1 == args.epochs:
            model.module.eval()
            dets = {}
            with torch.no_grad():
                for batch in val_loader:
                    out = model.module(batch["pillars"].to(device), batch["coords"].to(device), batch["num"].to(device),
                                       batch["batch_size"])
                    for sid, gt, pred in zip(batch["sids"], batch["gt"], decode(*out)):
                        dets[sid] = (pred, gt)
            model.module.train()
            parts = [None] * world
            dist.all_gather_object(parts, dets)
            if rank == 0:
                merged = {k: v for p in parts for k, v in p.items()}
                aps = center_distance_ap(merged, num_classes=len(C.classes), dist_thr=1.0)
                log.info("epoch %d AP@1m %s", epoch, {c: round(a, 4) for c, a in zip(C.classes, aps)})
        if rank == 0:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch,
                        "classes": C.classes}, os.path.join(args.out, "last.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
