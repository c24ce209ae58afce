"""PointPillars + center head, hard voxelization on the GPU (mmcv.ops.Voxelization) inside the model.

The DataLoader only reads and augments raw points; pillars are built on the device after the batch is moved.
Can be initialised from a checkpoint of an older DDP run (keys prefixed with "module.").

    torchrun --nproc_per_node=4 10_mmcv_voxel_gpu.py --data-root /data/kitti --load-from pretrained/pp_car_ddp.pth
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
from mmcv.ops import Voxelization
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lidar_det.augment import GTDatabaseSampler, random_flip, global_rot_scale
from lidar_det.metrics import bev_center_ap

CLASSES = ["Car"]
PC_RANGE = [0.0, -39.68, -3.0, 69.12, 39.68, 1.0]
VOXEL_SIZE = [0.16, 0.16, 4.0]
NX, NY = 432, 496
OUT_STRIDE = 2
MAX_OBJS = 64


def center_targets(boxes):
    H, W = NY // OUT_STRIDE, NX // OUT_STRIDE
    hm = np.zeros((1, H, W), np.float32)
    reg = np.zeros((MAX_OBJS, 8), np.float32)
    ind = np.zeros(MAX_OBJS, np.int64)
    mask = np.zeros(MAX_OBJS, np.float32)
    for k, b in enumerate(boxes[:MAX_OBJS]):
        fx = (b[0] - PC_RANGE[0]) / VOXEL_SIZE[0] / OUT_STRIDE
        fy = (b[1] - PC_RANGE[1]) / VOXEL_SIZE[1] / OUT_STRIDE
        cx, cy = int(fx), int(fy)
        if not (0 <= cx < W and 0 <= cy < H):
            continue
        r = max(2, int(0.3 * math.hypot(b[3], b[4]) / VOXEL_SIZE[0] / OUT_STRIDE))
        ys, xs = np.ogrid[-r:r + 1, -r:r + 1]
        g = np.exp(-(xs * xs + ys * ys) / (2 * ((2 * r + 1) / 6) ** 2))
        x0, x1, y0, y1 = max(cx - r, 0), min(cx + r + 1, W), max(cy - r, 0), min(cy + r + 1, H)
        hm[0, y0:y1, x0:x1] = np.maximum(hm[0, y0:y1, x0:x1], g[y0 - cy + r:y1 - cy + r, x0 - cx + r:x1 - cx + r])
        ind[k], mask[k] = cy * W + cx, 1
        reg[k] = [fx - cx, fy - cy, b[2], *np.log(b[3:6]), np.sin(b[6]), np.cos(b[6])]
    return hm, reg, ind, mask


class KittiRawPoints(Dataset):
    def __init__(self, root, split, training):
        self.root, self.training = root, training
        with open(os.path.join(root, f"kitti_infos_{split}.pkl"), "rb") as f:
            self.infos = pickle.load(f)
        self.db_sampler = GTDatabaseSampler(root, os.path.join(root, "kitti_dbinfos_train.pkl"),
                                            sample_groups={"Car": 15}, min_points={"Car": 5}) if training else None

    def __len__(self):
        return len(self.infos)

    def __getitem__(self, idx):
        info = self.infos[idx]
        fid = info["point_cloud"]["lidar_idx"]
        pts = np.fromfile(os.path.join(self.root, "training/velodyne_reduced", f"{fid}.bin"), np.float32).reshape(-1, 4)
        m = info["annos"]["name"] == "Car"
        boxes, names = info["annos"]["gt_boxes_lidar"][m].astype(np.float32), info["annos"]["name"][m]
        if self.training:
            pts, boxes, names = self.db_sampler(pts, boxes, names)
            pts, boxes = random_flip(pts, boxes)
            pts, boxes = global_rot_scale(pts, boxes, rot=(-0.785, 0.785), scale=(0.95, 1.05))
            pts = pts[np.random.permutation(len(pts))]
        r = np.array(PC_RANGE, np.float32)
        pts = pts[np.all((pts[:, :3] >= r[:3]) & (pts[:, :3] < r[3:]), 1)]
        boxes = boxes[np.all((boxes[:, :2] >= r[:2]) & (boxes[:, :2] < r[3:5]), 1)]
        hm, reg, ind, mask = center_targets(boxes)
        return {"points": pts, "hm": hm, "reg": reg, "ind": ind, "mask": mask, "frame_id": fid, "gt_boxes": boxes}


def collate(batch):
    out = {k: torch.from_numpy(np.stack([b[k] for b in batch])) for k in ("hm", "reg", "ind", "mask")}
    out["points"] = [torch.from_numpy(b["points"]) for b in batch]
    out["frame_id"] = [b["frame_id"] for b in batch]
    out["gt_boxes"] = [b["gt_boxes"] for b in batch]
    return out


def conv_bn_relu(cin, cout, stride=1):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout, eps=1e-3, momentum=0.01),
                         nn.ReLU(inplace=True))


class PillarCenter(nn.Module):
    def __init__(self):
        super().__init__()
        self.voxel_layer = Voxelization(VOXEL_SIZE, PC_RANGE, max_num_points=32, max_voxels=(16000, 40000))
        self.pfn_linear = nn.Linear(9, 64, bias=False)
        self.pfn_norm = nn.BatchNorm1d(64, eps=1e-3, momentum=0.01)
        self.stage1 = nn.Sequential(conv_bn_relu(64, 64, 2), *[conv_bn_relu(64, 64) for _ in range(3)])
        self.stage2 = nn.Sequential(conv_bn_relu(64, 128, 2), *[conv_bn_relu(128, 128) for _ in range(5)])
        self.stage3 = nn.Sequential(conv_bn_relu(128, 256, 2), *[conv_bn_relu(256, 256) for _ in range(5)])
        self.up1 = nn.Sequential(nn.ConvTranspose2d(64, 128, 1, 1, bias=False), nn.BatchNorm2d(128), nn.ReLU(inplace=True))
        self.up2 = nn.Sequential(nn.ConvTranspose2d(128, 128, 2, 2, bias=False), nn.BatchNorm2d(128), nn.ReLU(inplace=True))
        self.up3 = nn.Sequential(nn.ConvTranspose2d(256, 128, 4, 4, bias=False), nn.BatchNorm2d(128), nn.ReLU(inplace=True))
        self.hm_head = nn.Sequential(conv_bn_relu(384, 64), nn.Conv2d(64, 1, 1))
        self.reg_head = nn.Sequential(conv_bn_relu(384, 64), nn.Conv2d(64, 8, 1))
        nn.init.constant_(self.hm_head[-1].bias, -2.19)

    @torch.no_grad()
    def voxelize(self, points):
        voxels, coors, nums = [], [], []
        for i, p in enumerate(points):
            v, c, n = self.voxel_layer(p)
            voxels.append(v)
            coors.append(F.pad(c, (1, 0), value=i))
            nums.append(n)
        return torch.cat(voxels), torch.cat(coors), torch.cat(nums)

    def forward(self, points):
        voxels, coors, nums = self.voxelize(points)  # coors: batch, z, y, x
        mean = voxels[..., :3].sum(1, keepdim=True) / nums.clamp(min=1).view(-1, 1, 1).type_as(voxels)
        cx = coors[:, 3].type_as(voxels) * VOXEL_SIZE[0] + (VOXEL_SIZE[0] / 2 + PC_RANGE[0])
        cy = coors[:, 2].type_as(voxels) * VOXEL_SIZE[1] + (VOXEL_SIZE[1] / 2 + PC_RANGE[1])
        feats = torch.cat([voxels, voxels[..., :3] - mean, (voxels[..., 0] - cx[:, None]).unsqueeze(-1),
                           (voxels[..., 1] - cy[:, None]).unsqueeze(-1)], -1)
        feats = feats * (torch.arange(voxels.shape[1], device=voxels.device)[None] < nums[:, None]).unsqueeze(-1)
        x = F.relu(self.pfn_norm(self.pfn_linear(feats).transpose(1, 2))).max(-1)[0]
        bev = x.new_zeros(len(points), x.shape[1], NY * NX)
        bev[coors[:, 0].long(), :, (coors[:, 2] * NX + coors[:, 3]).long()] = x
        x1 = self.stage1(bev.view(len(points), -1, NY, NX))
        x2 = self.stage2(x1)
        x3 = self.stage3(x2)
        x = torch.cat([self.up1(x1), self.up2(x2), self.up3(x3)], 1)
        return self.hm_head(x), self.reg_head(x)


def compute_loss(hm_logit, reg_map, hm, reg, ind, mask):
    p = hm_logit.sigmoid().clamp(1e-4, 1 - 1e-4)
    pos = hm.eq(1).float()
    l_hm = -(torch.log(p) * (1 - p) ** 2 * pos + torch.log(1 - p) * p ** 2 * (1 - hm) ** 4 * (1 - pos)).sum()
    l_hm = l_hm / pos.sum().clamp(min=1)
    pr = reg_map.flatten(2).gather(2, ind.unsqueeze(1).expand(-1, 8, -1)).transpose(1, 2)
    m = mask.unsqueeze(-1)
    l_reg = F.l1_loss(pr * m, reg * m, reduction="sum") / (m.sum() * 8).clamp(min=1)
    return l_hm, l_reg


@torch.no_grad()
def decode(hm_logit, reg_map, k=50, thr=0.1):
    B, _, H, W = hm_logit.shape
    heat = hm_logit.sigmoid()
    heat = heat * (F.max_pool2d(heat, 3, 1, 1) == heat)
    scores, pix = heat.flatten(1).topk(k)
    r = reg_map.flatten(2).gather(2, pix.unsqueeze(1).expand(-1, 8, -1)).transpose(1, 2)
    x = ((pix % W).float() + r[..., 0]) * OUT_STRIDE * VOXEL_SIZE[0] + PC_RANGE[0]
    y = ((pix // W).float() + r[..., 1]) * OUT_STRIDE * VOXEL_SIZE[1] + PC_RANGE[1]
    boxes = torch.cat([x[..., None], y[..., None], r[..., 2:3], r[..., 3:6].exp(), torch.atan2(r[..., 6:7], r[..., 7:8])], -1)
    return [(boxes[b][scores[b] > thr].cpu().numpy(), scores[b][scores[b] > thr].cpu().numpy()) for b in range(B)]


def load_pretrained(model, path):
    state = torch.load(path, map_location="cpu")
    state = state.get("state_dict", state.get("model", state))
    state = {(k[len("module."):] if k.startswith("module.") else k): v for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    return missing, unexpected


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-root", default="/data/kitti")
    ap.add_argument("--work-dir", default="work_dirs/pp_center_car")
    ap.add_argument("--load-from", default=None)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--samples-per-gpu", type=int, default=6)
    ap.add_argument("--workers-per-gpu", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    np.random.seed(rank)

    train_set, val_set = KittiRawPoints(args.data_root, "train", True), KittiRawPoints(args.data_root, "val", False)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, args.samples_per_gpu, sampler=sampler, num_workers=args.workers_per_gpu,
                        collate_fn=collate, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, args.samples_per_gpu, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=args.workers_per_gpu, collate_fn=collate)

    model = PillarCenter()
    if args.load_from:
        missing, unexpected = load_pretrained(model, args.load_from)
        if rank == 0:
            print(f"loaded {args.load_from}: {len(missing)} missing, {len(unexpected)} unexpected keys", flush=True)
    model = DDP(nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device), device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, total_steps=args.epochs * len(loader), pct_start=0.4)
    os.makedirs(args.work_dir, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, batch in enumerate(loader):
            points = [p.to(device, non_blocking=True) for p in batch["points"]]
            tgt = [batch[k].to(device, non_blocking=True) for k in ("hm", "reg", "ind", "mask")]
            hm_logit, reg_map = model(points)
            l_hm, l_reg = compute_loss(hm_logit, reg_map, *tgt)
            optimizer.zero_grad(set_to_none=True)
            (l_hm + 0.25 * l_reg).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 35)
            optimizer.step()
            scheduler.step()
            if it % 50 == 0:
                stats = torch.stack([l_hm.detach(), l_reg.detach()])
                dist.all_reduce(stats)
                stats /= world
                if rank == 0:
                    print(f"[{epoch}][{it}/{len(loader)}] hm {stats[0]:.4f} reg {stats[1]:.4f} "
                          f"{(time.time() - t0) / (it + 1):.2f}s/it", flush=True)

        if (epoch + 1) % 5 == 0:
            net = model.module
            net.eval()
            dets = {}
            with torch.inference_mode():
                for batch in val_loader:
                    hm_logit, reg_map = net([p.to(device) for p in batch["points"]])
                    for fid, gt, (bx, sc) in zip(batch["frame_id"], batch["gt_boxes"], decode(hm_logit, reg_map)):
                        dets[fid] = {"boxes": bx, "scores": sc, "labels": np.zeros(len(sc), np.int64),
                                     "gt": gt, "gt_labels": np.zeros(len(gt), np.int64)}
            net.train()
            gathered = [None] * world
            dist.all_gather_object(gathered, dets)
            if rank == 0:
                merged = {k: v for d in gathered for k, v in d.items()}
                ap_car = bev_center_ap(merged, num_classes=1)[0]
                print(f"epoch {epoch}: Car BEV-center AP {ap_car:.4f} on {len(merged)} frames", flush=True)
                torch.save({"state_dict": model.module.state_dict(), "epoch": epoch},
                           os.path.join(args.work_dir, f"epoch_{epoch + 1}.pth"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
