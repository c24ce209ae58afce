"""PointPillars-style detector with a center-based head, KITTI 3-class.

Launched through tools/dist_train.sh:
    torchrun --nproc_per_node=$GPUS tools/train_pointpillars.py --cfg configs/pp_kitti_3class.yaml
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
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

CLASSES = ("Car", "Pedestrian", "Cyclist")
PC_RANGE = np.array([0.0, -39.68, -3.0, 69.12, 39.68, 1.0], dtype=np.float32)
VOXEL = np.array([0.16, 0.16, 4.0], dtype=np.float32)
GRID = ((PC_RANGE[3:5] - PC_RANGE[0:2]) / VOXEL[:2]).round().astype(np.int64)  # (nx, ny)
OUT_STRIDE = 2
MAX_OBJS = 64

logger = logging.getLogger("pp")


def parse_args():
    p = argparse.ArgumentParser("PointPillars KITTI")
    p.add_argument("--cfg", required=True)
    p.add_argument("--work-dir", default="work_dirs/pp_kitti_3class")
    p.add_argument("--resume", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--local_rank", type=int, default=0)
    args = p.parse_args()
    if "LOCAL_RANK" not in os.environ:
        os.environ["LOCAL_RANK"] = str(args.local_rank)
    return args


def init_dist(args, backend="nccl"):
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend=backend, init_method="env://")
    return dist.get_rank(), dist.get_world_size()


def gaussian_radius(h, w, min_overlap=0.1):
    a, b, c = 4, 2 * (h + w), (1 - min_overlap) * w * h
    return max(0, int((b + np.sqrt(b ** 2 - 4 * a * c)) / (2 * a)))


def draw_gaussian(hm, cx, cy, r):
    d = 2 * r + 1
    sigma = d / 6
    ys, xs = np.ogrid[-r:r + 1, -r:r + 1]
    g = np.exp(-(xs * xs + ys * ys) / (2 * sigma * sigma))
    H, W = hm.shape
    l, ri = min(cx, r), min(W - cx, r + 1)
    t, b = min(cy, r), min(H - cy, r + 1)
    hm[cy - t:cy + b, cx - l:cx + ri] = np.maximum(hm[cy - t:cy + b, cx - l:cx + ri], g[r - t:r + b, r - l:r + ri])


class KittiPillarDataset(Dataset):
    def __init__(self, root, info_file, training):
        self.root, self.training = root, training
        with open(os.path.join(root, info_file), "rb") as f:
            self.infos = pickle.load(f)

    def __len__(self):
        return len(self.infos)

    def _augment(self, pts, boxes):
        if np.random.rand() < 0.5:
            pts[:, 1] *= -1
            boxes[:, 1] *= -1
            boxes[:, 6] *= -1
        rot = np.random.uniform(-np.pi / 4, np.pi / 4)
        c, s = np.cos(rot), np.sin(rot)
        R = np.array([[c, -s], [s, c]], dtype=np.float32)
        pts[:, :2] = pts[:, :2] @ R.T
        boxes[:, :2] = boxes[:, :2] @ R.T
        boxes[:, 6] += rot
        scale = np.random.uniform(0.95, 1.05)
        pts[:, :3] *= scale
        boxes[:, :6] *= scale
        return pts, boxes

    def __getitem__(self, idx):
        info = self.infos[idx]
        pts = np.fromfile(os.path.join(self.root, info["velodyne_path"]), dtype=np.float32).reshape(-1, 4)
        annos = info["annos"]
        keep = np.isin(annos["name"], CLASSES)
        boxes = annos["gt_boxes_lidar"][keep].astype(np.float32)
        labels = np.array([CLASSES.index(n) for n in annos["name"][keep]], dtype=np.int64)
        if self.training:
            pts, boxes = self._augment(pts, boxes)
        m = np.all((pts[:, :3] >= PC_RANGE[:3]) & (pts[:, :3] < PC_RANGE[3:]), axis=1)
        pts = pts[m]

        fw, fh = GRID[0] // OUT_STRIDE, GRID[1] // OUT_STRIDE
        hm = np.zeros((len(CLASSES), fh, fw), np.float32)
        reg = np.zeros((MAX_OBJS, 8), np.float32)
        ind = np.zeros(MAX_OBJS, np.int64)
        msk = np.zeros(MAX_OBJS, np.float32)
        for k, (b, lab) in enumerate(zip(boxes[:MAX_OBJS], labels[:MAX_OBJS])):
            fx = (b[0] - PC_RANGE[0]) / VOXEL[0] / OUT_STRIDE
            fy = (b[1] - PC_RANGE[1]) / VOXEL[1] / OUT_STRIDE
            ix, iy = int(fx), int(fy)
            if not (0 <= ix < fw and 0 <= iy < fh):
                continue
            r = max(2, gaussian_radius(b[4] / VOXEL[1] / OUT_STRIDE, b[3] / VOXEL[0] / OUT_STRIDE))
            draw_gaussian(hm[lab], ix, iy, r)
            ind[k], msk[k] = iy * fw + ix, 1.0
            reg[k] = [fx - ix, fy - iy, b[2], np.log(b[3]), np.log(b[4]), np.log(b[5]), np.sin(b[6]), np.cos(b[6])]
        return dict(points=torch.from_numpy(pts), hm=hm, reg=reg, ind=ind, mask=msk,
                    gt_boxes=boxes, gt_labels=labels, sample_idx=info["image_idx"])


def collate_pillars(batch):
    pts = [torch.cat([torch.full((len(b["points"]), 1), i, dtype=torch.float32), b["points"]], 1)
           for i, b in enumerate(batch)]
    out = {"points": torch.cat(pts, 0)}
    for k in ("hm", "reg", "ind", "mask"):
        out[k] = torch.from_numpy(np.stack([b[k] for b in batch]))
    out["gt_boxes"] = [b["gt_boxes"] for b in batch]
    out["gt_labels"] = [b["gt_labels"] for b in batch]
    out["sample_idx"] = [b["sample_idx"] for b in batch]
    return out


class PillarVFE(nn.Module):
    def __init__(self, out_ch=64):
        super().__init__()
        self.lin = nn.Linear(9, out_ch, bias=False)
        self.bn = nn.BatchNorm1d(out_ch, eps=1e-3, momentum=0.01)
        self.out_ch = out_ch

    def forward(self, points, batch_size):
        dev = points.device
        pc_min = torch.as_tensor(PC_RANGE[:3], device=dev)
        vs = torch.as_tensor(VOXEL, device=dev)
        coords = ((points[:, 1:4] - pc_min) / vs).long()
        nx, ny = int(GRID[0]), int(GRID[1])
        flat = points[:, 0].long() * nx * ny + coords[:, 1] * nx + coords[:, 0]
        uniq, inv = torch.unique(flat, return_inverse=True)
        cnt = torch.zeros(len(uniq), device=dev).index_add_(0, inv, torch.ones_like(inv, dtype=torch.float))
        mean = torch.zeros(len(uniq), 3, device=dev).index_add_(0, inv, points[:, 1:4]) / cnt[:, None]
        centre = (coords[:, :2].float() + 0.5) * vs[:2] + pc_min[:2]
        feats = torch.cat([points[:, 1:5], points[:, 1:4] - mean[inv], points[:, 1:3] - centre], 1)
        x = F.relu(self.bn(self.lin(feats)))
        pillar = torch.zeros(len(uniq), self.out_ch, device=dev, dtype=x.dtype)
        pillar = pillar.scatter_reduce(0, inv[:, None].expand_as(x), x, reduce="amax", include_self=False)
        canvas = torch.zeros(batch_size * ny * nx, self.out_ch, device=dev, dtype=x.dtype)
        canvas[uniq] = pillar
        return canvas.view(batch_size, ny, nx, self.out_ch).permute(0, 3, 1, 2).contiguous()


def conv_bn(cin, cout, stride=1):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
                         nn.BatchNorm2d(cout, eps=1e-3, momentum=0.01), nn.ReLU(inplace=True))


class PointPillarsCenter(nn.Module):
    def __init__(self, num_classes=3):
        super().__init__()
        self.vfe = PillarVFE(64)
        self.block1 = nn.Sequential(conv_bn(64, 64, 2), *[conv_bn(64, 64) for _ in range(3)])
        self.block2 = nn.Sequential(conv_bn(64, 128, 2), *[conv_bn(128, 128) for _ in range(5)])
        self.block3 = nn.Sequential(conv_bn(128, 256, 2), *[conv_bn(256, 256) for _ in range(5)])
        self.up1 = nn.Sequential(nn.ConvTranspose2d(64, 128, 1, 1, bias=False), nn.BatchNorm2d(128), nn.ReLU())
        self.up2 = nn.Sequential(nn.ConvTranspose2d(128, 128, 2, 2, bias=False), nn.BatchNorm2d(128), nn.ReLU())
        self.up3 = nn.Sequential(nn.ConvTranspose2d(256, 128, 4, 4, bias=False), nn.BatchNorm2d(128), nn.ReLU())
        self.hm_head = nn.Sequential(conv_bn(384, 64), nn.Conv2d(64, num_classes, 1))
        self.reg_head = nn.Sequential(conv_bn(384, 64), nn.Conv2d(64, 8, 1))
        self.hm_head[-1].bias.data.fill_(-2.19)

    def forward(self, points, batch_size):
        x = self.vfe(points, batch_size)
        x1 = self.block1(x)
        x2 = self.block2(x1)
        x3 = self.block3(x2)
        feat = torch.cat([self.up1(x1), self.up2(x2), self.up3(x3)], 1)
        return self.hm_head(feat), self.reg_head(feat)


def focal_heatmap_loss(pred, gt):
    pred = pred.sigmoid().clamp(1e-4, 1 - 1e-4)
    pos = gt.eq(1).float()
    neg_w = torch.pow(1 - gt, 4)
    pos_loss = torch.log(pred) * torch.pow(1 - pred, 2) * pos
    neg_loss = torch.log(1 - pred) * torch.pow(pred, 2) * neg_w * (1 - pos)
    return -(pos_loss.sum() + neg_loss.sum()) / pos.sum().clamp(min=1.0)


def compute_loss(hm_pred, reg_pred, batch):
    B, C, H, W = reg_pred.shape
    hm_loss = focal_heatmap_loss(hm_pred, batch["hm"])
    feat = reg_pred.view(B, C, H * W).permute(0, 2, 1)
    pred = feat.gather(1, batch["ind"][..., None].expand(-1, -1, C))
    m = batch["mask"][..., None]
    reg_loss = (F.l1_loss(pred * m, batch["reg"] * m, reduction="sum") / m.sum().clamp(min=1.0))
    return hm_loss + 2.0 * reg_loss, {"hm": hm_loss.detach(), "reg": reg_loss.detach()}


@torch.no_grad()
def decode(hm_pred, reg_pred, k=100):
    B, C, H, W = hm_pred.shape
    hm = hm_pred.sigmoid()
    hm = hm * (F.max_pool2d(hm, 3, 1, 1) == hm).float()
    scores, idx = hm.view(B, -1).topk(k)
    labels, pix = idx // (H * W), idx % (H * W)
    ys, xs = (pix // W).float(), (pix % W).float()
    reg = reg_pred.view(B, 8, -1).gather(2, pix[:, None].expand(-1, 8, -1))
    x = (xs + reg[:, 0]) * OUT_STRIDE * VOXEL[0] + PC_RANGE[0]
    y = (ys + reg[:, 1]) * OUT_STRIDE * VOXEL[1] + PC_RANGE[1]
    dims = reg[:, 3:6].exp()
    yaw = torch.atan2(reg[:, 6], reg[:, 7])
    boxes = torch.stack([x, y, reg[:, 2], dims[:, 0], dims[:, 1], dims[:, 2], yaw], -1)
    return [(boxes[b].cpu().numpy(), scores[b].cpu().numpy(), labels[b].cpu().numpy()) for b in range(B)]


def bev_center_ap(preds, gts, num_classes, thr=1.0):
    aps = []
    for c in range(num_classes):
        recs, npos = [], 0
        for (pb, ps, pl), (gb, gl) in zip(preds, gts):
            g = gb[gl == c][:, :2]
            npos += len(g)
            p, s = pb[pl == c], ps[pl == c]
            taken = np.zeros(len(g), bool)
            for i in np.argsort(-s):
                hit = 0
                if len(g):
                    d = np.linalg.norm(g - p[i, :2], axis=1)
                    d[taken] = np.inf
                    j = int(d.argmin())
                    if d[j] < thr:
                        taken[j], hit = True, 1
                recs.append((s[i], hit))
        if npos == 0:
            continue
        recs.sort(key=lambda r: -r[0])
        tp = np.cumsum([r[1] for r in recs])
        fp = np.cumsum([1 - r[1] for r in recs])
        rec, prec = tp / npos, tp / np.maximum(tp + fp, 1e-9)
        ap = np.mean([prec[rec >= t].max() if (rec >= t).any() else 0.0 for t in np.linspace(1 / 40, 1, 40)])
        aps.append(ap)
    return float(np.mean(aps)) if aps else 0.0


@torch.no_grad()
def evaluate(model, loader, rank, world_size):
    model.eval()
    preds, gts = [], []
    for batch in loader:
        pts = batch["points"].cuda(non_blocking=True)
        hm, reg = model(pts, len(batch["sample_idx"]))
        preds += decode(hm, reg)
        gts += list(zip(batch["gt_boxes"], batch["gt_labels"]))
    gathered = [None] * world_size
    dist.all_gather_object(gathered, (preds, gts))
    ap = 0.0
    if rank == 0:
        all_p = [p for g in gathered for p in g[0]]
        all_g = [p for g in gathered for p in g[1]]
        ap = bev_center_ap(all_p, all_g, len(CLASSES))
    model.train()
    return ap


def main():
    args = parse_args()
    with open(args.cfg) as f:
        cfg = yaml.safe_load(f)
    rank, world_size = init_dist(args)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format="%(asctime)s %(levelname)s %(message)s")
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)
    os.makedirs(args.work_dir, exist_ok=True)

    train_set = KittiPillarDataset(cfg["data_root"], "kitti_infos_train.pkl", training=True)
    val_set = KittiPillarDataset(cfg["data_root"], "kitti_infos_val.pkl", training=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=cfg["samples_per_gpu"], sampler=train_sampler,
                              num_workers=cfg["workers_per_gpu"], collate_fn=collate_pillars,
                              pin_memory=True, drop_last=True)
    val_idx = list(range(rank, len(val_set), world_size))
    val_loader = DataLoader(torch.utils.data.Subset(val_set, val_idx), batch_size=cfg["samples_per_gpu"],
                            num_workers=cfg["workers_per_gpu"], collate_fn=collate_pillars)

    model = PointPillarsCenter(len(CLASSES))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda()
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    lr = cfg["lr"] * cfg["samples_per_gpu"] * world_size / 16
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    total_iters = cfg["epochs"] * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=total_iters,
                                                    pct_start=0.4, div_factor=10)
    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1

    best_ap = 0.0
    for epoch in range(start_epoch, cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, batch in enumerate(train_loader):
            pts = batch["points"].cuda(non_blocking=True)
            targets = {k: batch[k].cuda(non_blocking=True) for k in ("hm", "reg", "ind", "mask")}
            hm, reg = model(pts, len(batch["sample_idx"]))
            loss, parts = compute_loss(hm, reg, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            optimizer.step()
            scheduler.step()
            if it % 50 == 0:
                logger.info("epoch %d iter %d/%d loss %.4f hm %.4f reg %.4f lr %.2e (%.1fs)", epoch, it,
                            len(train_loader), loss.item(), parts["hm"].item(), parts["reg"].item(),
                            optimizer.param_groups[0]["lr"], time.time() - t0)

        ap = evaluate(model.module, val_loader, rank, world_size)
        if rank == 0:
            logger.info("epoch %d BEV center AP %.4f", epoch, ap)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch}
            torch.save(state, os.path.join(args.work_dir, "latest.pth"))
            if ap > best_ap:
                best_ap = ap
                torch.save(state, os.path.join(args.work_dir, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
