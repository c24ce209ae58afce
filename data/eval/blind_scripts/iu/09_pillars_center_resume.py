"""CenterPoint-Pillar training (KITTI / custom LiDAR in KITTI layout) with resume support.

Launch:
    torchrun --standalone --nproc_per_node=8 09_pillars_center_resume.py --cfg cfgs/cp_pillar.yaml
    torchrun --standalone --nproc_per_node=8 09_pillars_center_resume.py --cfg cfgs/cp_pillar.yaml --resume runs/cp_pillar/last.pth
"""
import argparse
import math
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

DEFAULT_CFG = {
    "classes": ["Car", "Pedestrian", "Cyclist"],
    "pc_range": [0.0, -39.68, -3.0, 69.12, 39.68, 1.0],
    "voxel_size": [0.16, 0.16, 4.0],
    "max_points_per_pillar": 20,
    "max_pillars": {"train": 16000, "val": 40000},
    "out_stride": 2,
    "max_objs": 128,
    "batch_size_per_gpu": 4,
    "epochs": 80,
    "lr": 0.003,
    "weight_decay": 0.01,
    "num_workers": 6,
    "data_root": "/datasets/kitti",
    "work_dir": "runs/cp_pillar",
}


def load_cfg(path):
    cfg = dict(DEFAULT_CFG)
    if path:
        with open(path) as f:
            cfg.update(yaml.safe_load(f) or {})
    cfg["pc_range"] = np.array(cfg["pc_range"], dtype=np.float32)
    cfg["voxel_size"] = np.array(cfg["voxel_size"], dtype=np.float32)
    cfg["grid"] = np.round((cfg["pc_range"][3:] - cfg["pc_range"][:3]) / cfg["voxel_size"]).astype(np.int64)
    return cfg


# ------------------------------------------------------------------ targets
def gaussian_radius(h, w, min_overlap=0.1):
    b1, c1 = h + w, w * h * (1 - min_overlap) / (1 + min_overlap)
    r1 = (b1 + math.sqrt(b1 ** 2 - 4 * c1)) / 2
    b2, c2 = 2 * (h + w), (1 - min_overlap) * w * h
    r2 = (b2 + math.sqrt(b2 ** 2 - 16 * c2)) / 2
    a3, b3, c3 = 4 * min_overlap, -2 * min_overlap * (h + w), (min_overlap - 1) * w * h
    r3 = (b3 + math.sqrt(b3 ** 2 - 4 * a3 * c3)) / 2
    return min(r1, r2, r3)


def draw_gaussian(hm, cx, cy, radius):
    sigma = (2 * radius + 1) / 6
    y, x = np.ogrid[-radius:radius + 1, -radius:radius + 1]
    g = np.exp(-(x * x + y * y) / (2 * sigma * sigma))
    H, W = hm.shape
    l, r = min(cx, radius), min(W - cx, radius + 1)
    t, b = min(cy, radius), min(H - cy, radius + 1)
    np.maximum(hm[cy - t:cy + b, cx - l:cx + r], g[radius - t:radius + b, radius - l:radius + r], out=hm[cy - t:cy + b, cx - l:cx + r])


def build_targets(boxes, labels, cfg):
    stride, vs, pr = cfg["out_stride"], cfg["voxel_size"], cfg["pc_range"]
    H, W = int(cfg["grid"][1]) // stride, int(cfg["grid"][0]) // stride
    hm = np.zeros((len(cfg["classes"]), H, W), np.float32)
    reg = np.zeros((cfg["max_objs"], 8), np.float32)
    ind = np.zeros(cfg["max_objs"], np.int64)
    mask = np.zeros(cfg["max_objs"], np.float32)
    for k, (box, lab) in enumerate(zip(boxes[:cfg["max_objs"]], labels)):
        x = (box[0] - pr[0]) / vs[0] / stride
        y = (box[1] - pr[1]) / vs[1] / stride
        cx, cy = int(x), int(y)
        if not (0 <= cx < W and 0 <= cy < H):
            continue
        radius = max(2, int(gaussian_radius(box[4] / vs[1] / stride, box[3] / vs[0] / stride)))
        draw_gaussian(hm[lab], cx, cy, radius)
        ind[k], mask[k] = cy * W + cx, 1.0
        reg[k] = [x - cx, y - cy, box[2], np.log(box[3]), np.log(box[4]), np.log(box[5]), np.sin(box[6]), np.cos(box[6])]
    return hm, reg, ind, mask


# ------------------------------------------------------------------ dataset
class PillarDataset(Dataset):
    def __init__(self, cfg, split):
        self.cfg, self.split, self.training = cfg, split, split == "train"
        root = cfg["data_root"]
        with open(os.path.join(root, f"kitti_infos_{split}.pkl"), "rb") as f:
            self.infos = pickle.load(f)
        self.lidar_dir = os.path.join(root, "training", "velodyne_reduced")

    def __len__(self):
        return len(self.infos)

    def augment(self, pts, boxes):
        if np.random.rand() < 0.5:
            pts[:, 1] = -pts[:, 1]
            boxes[:, 1], boxes[:, 6] = -boxes[:, 1], -boxes[:, 6]
        a = np.random.uniform(-np.pi / 4, np.pi / 4)
        rot = np.array([[np.cos(a), -np.sin(a)], [np.sin(a), np.cos(a)]], np.float32)
        pts[:, :2] = pts[:, :2] @ rot.T
        boxes[:, :2] = boxes[:, :2] @ rot.T
        boxes[:, 6] += a
        s = np.random.uniform(0.95, 1.05)
        pts[:, :3] *= s
        boxes[:, :6] *= s
        return pts, boxes

    def pillarize(self, pts):
        cfg = self.cfg
        grid, T = cfg["grid"], cfg["max_points_per_pillar"]
        ij = np.floor((pts[:, :2] - cfg["pc_range"][:2]) / cfg["voxel_size"][:2]).astype(np.int64)
        key = ij[:, 1] * grid[0] + ij[:, 0]
        order = np.argsort(key, kind="stable")
        pts, ij, key = pts[order], ij[order], key[order]
        uniq, first, cnt = np.unique(key, return_index=True, return_counts=True)
        slot = np.arange(len(key)) - np.repeat(first, cnt)
        pid = np.repeat(np.arange(len(uniq)), cnt)
        ok = slot < T
        pillars = np.zeros((len(uniq), T, 4), np.float32)
        pillars[pid[ok], slot[ok]] = pts[ok]
        num = np.minimum(cnt, T).astype(np.int32)
        yx = ij[first][:, ::-1].astype(np.int32)
        cap = cfg["max_pillars"]["train" if self.training else "val"]
        if len(uniq) > cap:
            sel = np.random.choice(len(uniq), cap, replace=False)
            pillars, num, yx = pillars[sel], num[sel], yx[sel]
        return pillars, yx, num

    def __getitem__(self, i):
        info = self.infos[i]
        fid = info["point_cloud"]["lidar_idx"]
        pts = np.fromfile(os.path.join(self.lidar_dir, f"{fid}.bin"), dtype=np.float32).reshape(-1, 4)
        annos = info["annos"]
        keep = np.isin(annos["name"], self.cfg["classes"])
        boxes = annos["gt_boxes_lidar"][keep].astype(np.float32).copy()
        labels = np.array([self.cfg["classes"].index(n) for n in annos["name"][keep]], np.int64)
        if self.training:
            pts, boxes = self.augment(pts, boxes)
        pr = self.cfg["pc_range"]
        pts = pts[np.all((pts[:, :3] >= pr[:3]) & (pts[:, :3] < pr[3:]), axis=1)]
        inb = np.all((boxes[:, :2] >= pr[:2]) & (boxes[:, :2] < pr[3:5]), axis=1)
        boxes, labels = boxes[inb], labels[inb]
        pillars, yx, num = self.pillarize(pts)
        hm, reg, ind, mask = build_targets(boxes, labels, self.cfg)
        return dict(pillars=pillars, coords=yx, num=num, hm=hm, reg=reg, ind=ind, mask=mask,
                    frame_id=fid, gt_boxes=boxes, gt_labels=labels)


def collate_fn(samples):
    out = {"batch_size": len(samples), "frame_id": [s["frame_id"] for s in samples],
           "gt_boxes": [s["gt_boxes"] for s in samples], "gt_labels": [s["gt_labels"] for s in samples]}
    out["pillars"] = torch.from_numpy(np.concatenate([s["pillars"] for s in samples]))
    out["num"] = torch.from_numpy(np.concatenate([s["num"] for s in samples]))
    out["coords"] = torch.from_numpy(np.concatenate(
        [np.concatenate([np.full((len(s["coords"]), 1), b, np.int32), s["coords"]], 1) for b, s in enumerate(samples)])).long()
    for k in ("hm", "reg", "ind", "mask"):
        out[k] = torch.from_numpy(np.stack([s[k] for s in samples]))
    return out


# ------------------------------------------------------------------ model
def conv_bn(cin, cout, stride=1):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout, eps=1e-3, momentum=0.01), nn.ReLU(inplace=True))


class CenterPointPillar(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.nx, self.ny = int(cfg["grid"][0]), int(cfg["grid"][1])
        self.register_buffer("vs", torch.tensor(cfg["voxel_size"][:2]))
        self.register_buffer("pmin", torch.tensor(cfg["pc_range"][:2]))
        self.pfn = nn.Sequential(nn.Linear(9, 64, bias=False))
        self.pfn_bn = nn.BatchNorm1d(64, eps=1e-3, momentum=0.01)
        self.down = nn.ModuleList([
            nn.Sequential(conv_bn(64, 64, 2), *[conv_bn(64, 64) for _ in range(3)]),
            nn.Sequential(conv_bn(64, 128, 2), *[conv_bn(128, 128) for _ in range(5)]),
            nn.Sequential(conv_bn(128, 256, 2), *[conv_bn(256, 256) for _ in range(5)]),
        ])
        self.up = nn.ModuleList([
            nn.Sequential(nn.Conv2d(64, 128, 1, bias=False), nn.BatchNorm2d(128), nn.ReLU(inplace=True)),
            nn.Sequential(nn.ConvTranspose2d(128, 128, 2, 2, bias=False), nn.BatchNorm2d(128), nn.ReLU(inplace=True)),
            nn.Sequential(nn.ConvTranspose2d(256, 128, 4, 4, bias=False), nn.BatchNorm2d(128), nn.ReLU(inplace=True)),
        ])
        self.shared = conv_bn(384, 64)
        self.hm_head = nn.Sequential(conv_bn(64, 64), nn.Conv2d(64, len(cfg["classes"]), 1))
        self.reg_head = nn.Sequential(conv_bn(64, 64), nn.Conv2d(64, 8, 1))
        nn.init.constant_(self.hm_head[-1].bias, -2.19)

    def forward(self, pillars, coords, num, batch_size):
        valid = (torch.arange(pillars.shape[1], device=pillars.device)[None] < num[:, None]).unsqueeze(-1)
        mean = pillars[..., :3].sum(1, keepdim=True) / num.clamp(min=1)[:, None, None]
        ctr = coords[:, [2, 1]].float() * self.vs + self.vs / 2 + self.pmin
        f = torch.cat([pillars, pillars[..., :3] - mean, pillars[..., :2] - ctr[:, None]], -1) * valid
        f = F.relu(self.pfn_bn(self.pfn(f).transpose(1, 2))).max(-1)[0]
        bev = f.new_zeros(batch_size, f.shape[1], self.ny * self.nx)
        bev[coords[:, 0], :, coords[:, 1] * self.nx + coords[:, 2]] = f
        x = bev.view(batch_size, -1, self.ny, self.nx)
        feats = []
        for d, u in zip(self.down, self.up):
            x = d(x)
            feats.append(u(x))
        x = self.shared(torch.cat(feats, 1))
        return self.hm_head(x), self.reg_head(x)


def heatmap_focal_loss(logits, gt):
    pred = logits.sigmoid().clamp(1e-4, 1 - 1e-4)
    pos = gt.eq(1).float()
    pos_loss = (torch.log(pred) * (1 - pred) ** 2 * pos).sum()
    neg_loss = (torch.log(1 - pred) * pred ** 2 * (1 - gt) ** 4 * (1 - pos)).sum()
    return -(pos_loss + neg_loss) / pos.sum().clamp(min=1)


def gather_feat(fmap, ind):
    B, C = fmap.shape[:2]
    return fmap.view(B, C, -1).gather(2, ind[:, None, :].expand(-1, C, -1)).permute(0, 2, 1)


def reg_l1_loss(reg_map, ind, mask, target):
    pred = gather_feat(reg_map, ind)
    m = mask.unsqueeze(-1)
    weights = torch.tensor([1, 1, 1, 1, 1, 1, 1, 1], device=pred.device, dtype=pred.dtype)
    return (F.l1_loss(pred * m, target * m, reduction="none") * weights).sum() / (mask.sum().clamp(min=1) * 8)


# ------------------------------------------------------------------ training
def all_reduce_mean(t):
    t = t.clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    totals = torch.zeros(3, device=device)
    for batch in loader:
        batch = {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}
        hm_logits, reg = model.module(batch["pillars"], batch["coords"], batch["num"], batch["batch_size"])
        totals[0] += heatmap_focal_loss(hm_logits, batch["hm"]) * batch["batch_size"]
        totals[1] += reg_l1_loss(reg, batch["ind"], batch["mask"], batch["reg"]) * batch["batch_size"]
        totals[2] += batch["batch_size"]
    dist.all_reduce(totals)
    model.train()
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def save_checkpoint(path, model, optimizer, scheduler, epoch):
    tmp = path + ".tmp"
    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "epoch": epoch}, tmp)
    os.replace(tmp, path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cfg", default=None)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--log_interval", type=int, default=20)
    args = parser.parse_args()
    cfg = load_cfg(args.cfg)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    np.random.seed(1234 + rank)
    torch.manual_seed(1234)
    if rank == 0:
        os.makedirs(cfg["work_dir"], exist_ok=True)

    ds = PillarDataset(cfg, "train")
    sampler = DistributedSampler(ds, shuffle=True)
    loader = DataLoader(ds, batch_size=cfg["batch_size_per_gpu"], sampler=sampler, num_workers=cfg["num_workers"],
                        collate_fn=collate_fn, pin_memory=True, drop_last=True, persistent_workers=True)

    val_ds = PillarDataset(cfg, "val")
    val_loader = DataLoader(val_ds, batch_size=cfg["batch_size_per_gpu"], sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=2, collate_fn=collate_fn)

    model = CenterPointPillar(cfg)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    total_steps = cfg["epochs"] * len(loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=cfg["lr"], total_steps=total_steps, pct_start=0.4)

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1
        if rank == 0:
            print(f"resumed from {args.resume} at epoch {start_epoch}", flush=True)
    model = DDP(model, device_ids=[local_rank])

    for epoch in range(start_epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for it, batch in enumerate(loader):
            batch = {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}
            hm_logits, reg = model(batch["pillars"], batch["coords"], batch["num"], batch["batch_size"])
            l_hm = heatmap_focal_loss(hm_logits, batch["hm"])
            l_reg = reg_l1_loss(reg, batch["ind"], batch["mask"], batch["reg"])
            loss = l_hm + 0.25 * l_reg
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 35.0)
            optimizer.step()
            scheduler.step()
            if it % args.log_interval == 0:
                stats = all_reduce_mean(torch.stack([l_hm.detach(), l_reg.detach()]))
                if rank == 0:
                    print(f"[ep {epoch} it {it}/{len(loader)}] hm {stats[0]:.4f} reg {stats[1]:.4f} "
                          f"lr {scheduler.get_last_lr()[0]:.2e} {(time.time() - tic) / (it + 1):.2f}s/it", flush=True)
        if (epoch + 1) % 5 == 0:
            v_hm, v_reg = validate(model, val_loader, device)
            if rank == 0:
                print(f"[ep {epoch}] val hm {v_hm:.4f} reg {v_reg:.4f}", flush=True)
        if rank == 0:
            save_checkpoint(os.path.join(cfg["work_dir"], "last.pth"), model, optimizer, scheduler, epoch)
            if (epoch + 1) % 10 == 0:
                save_checkpoint(os.path.join(cfg["work_dir"], f"epoch_{epoch + 1}.pth"), model, optimizer, scheduler, epoch)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
