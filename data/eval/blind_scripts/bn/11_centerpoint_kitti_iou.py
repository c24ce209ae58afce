"""
CenterPoint-Voxel on KITTI with an IoU-aware rescoring branch (spconv 2.x).

The IoU branch is only supervised after `--iou_start_epoch` (its targets are
meaningless while the box regression is still random), so during the first
epochs its parameters get no gradient.

    torchrun --nproc_per_node=8 train_centerpoint.py --cfg_root data/kitti --batch_size 4
"""
import argparse
import os
import pickle
import time
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

import spconv.pytorch as spconv
from spconv.pytorch.utils import PointToVoxel

PC_RANGE = np.array([0, -40, -3, 70.4, 40, 1], dtype=np.float32)
VOXEL = np.array([0.05, 0.05, 0.1], dtype=np.float32)
CLASSES = ("Car", "Pedestrian", "Cyclist")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--cfg_root", default="data/kitti")
    p.add_argument("--batch_size", type=int, default=4, help="per GPU")
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--lr", type=float, default=0.003, help="for 32 samples per step")
    p.add_argument("--iou_start_epoch", type=int, default=10)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--out", default="output/centerpoint_iou")
    return p.parse_args()


def build_db_infos(root, infos, out_file):
    """Ground-truth database for copy-paste augmentation: point counts per gt box."""
    db = defaultdict(list)
    for info in infos:
        annos = info["annos"]
        for name, box, npts in zip(annos["name"], annos["gt_boxes_lidar"], annos["num_points_in_gt"]):
            if name in CLASSES and npts >= 5:
                db[name].append({"frame": info["point_cloud"]["lidar_idx"], "box": box, "num_points": int(npts)})
    tmp = out_file + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(dict(db), f)
    os.replace(tmp, out_file)


class KittiDet(Dataset):
    def __init__(self, root, split, db_infos=None):
        with open(os.path.join(root, f"kitti_infos_{split}.pkl"), "rb") as f:
            self.infos = pickle.load(f)
        self.root, self.train, self.db = root, split == "train", db_infos
        self.vox = PointToVoxel(vsize_xyz=VOXEL.tolist(), coors_range_xyz=PC_RANGE.tolist(), num_point_features=4,
                                max_num_voxels=16000 if self.train else 40000, max_num_points_per_voxel=5)

    def __len__(self):
        return len(self.infos)

    def __getitem__(self, idx):
        info = self.infos[idx]
        fid = info["point_cloud"]["lidar_idx"]
        pts = np.fromfile(os.path.join(self.root, "training/velodyne", f"{fid}.bin"), np.float32).reshape(-1, 4)
        a = info["annos"]
        m = np.isin(a["name"], CLASSES)
        boxes = a["gt_boxes_lidar"][m].astype(np.float32)
        labels = np.array([CLASSES.index(n) for n in a["name"][m]], np.int64)
        if self.train:
            if np.random.rand() < 0.5:
                pts[:, 1] *= -1
                boxes[:, 1] *= -1
                boxes[:, 6] *= -1
            s = np.random.uniform(0.95, 1.05)
            pts[:, :3] *= s
            boxes[:, :6] *= s
        vox, coords, npts = self.vox(torch.from_numpy(pts))
        return vox, coords, npts, torch.from_numpy(boxes), torch.from_numpy(labels), fid


def collate(batch):
    vox, coords, npts, boxes, labels, fids = zip(*batch)
    coords = torch.cat([F.pad(c, (1, 0), value=i) for i, c in enumerate(coords)])
    return torch.cat(vox), coords, torch.cat(npts), list(boxes), list(labels), list(fids)


def sp_block(cin, cout, key, stride=None):
    conv = spconv.SubMConv3d(cin, cout, 3, padding=1, bias=False, indice_key=key) if stride is None else \
        spconv.SparseConv3d(cin, cout, 3, stride=stride, padding=1, bias=False, indice_key=key)
    return spconv.SparseSequential(conv, nn.BatchNorm1d(cout), nn.ReLU())


class CenterPointIoU(nn.Module):
    def __init__(self, num_classes=3):
        super().__init__()
        g = np.round((PC_RANGE[3:] - PC_RANGE[:3]) / VOXEL).astype(int)
        self.shape = [g[2] + 1, g[1], g[0]]
        self.enc = spconv.SparseSequential(
            sp_block(4, 16, "s1"), sp_block(16, 32, "d2", 2), sp_block(32, 32, "s2"),
            sp_block(32, 64, "d3", 2), sp_block(64, 64, "s3"), sp_block(64, 128, "d4", (1, 2, 2)),
            sp_block(128, 128, "s4"))
        self.bev = nn.Sequential(nn.Conv2d(128 * 11, 256, 3, padding=1, bias=False), nn.BatchNorm2d(256), nn.ReLU(),
                                 nn.Conv2d(256, 128, 3, padding=1, bias=False), nn.BatchNorm2d(128), nn.ReLU())
        self.hm = nn.Conv2d(128, num_classes, 3, padding=1)
        self.reg = nn.Conv2d(128, 8, 3, padding=1)
        self.iou = nn.Sequential(nn.Conv2d(128, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 1, 1))
        nn.init.constant_(self.hm.bias, -2.19)

    def forward(self, vox, coords, npts, bs):
        feat = vox.sum(1) / npts.clamp(min=1).unsqueeze(1).float()
        x = self.enc(spconv.SparseConvTensor(feat, coords.int(), self.shape, bs)).dense()
        x = self.bev(x.flatten(1, 2))
        return self.hm(x), self.reg(x), self.iou(x)


def targets(boxes, labels, hm_shape, device):
    b, c, h, w = hm_shape
    hm = torch.zeros(hm_shape, device=device)
    reg = torch.zeros(b, 8, h, w, device=device)
    mask = torch.zeros(b, h, w, device=device, dtype=torch.bool)
    cell = VOXEL[:2] * 8
    yy, xx = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    for i in range(b):
        for box, lab in zip(boxes[i].tolist(), labels[i].tolist()):
            cx, cy = (box[0] - PC_RANGE[0]) / cell[0], (box[1] - PC_RANGE[1]) / cell[1]
            ix, iy = int(cx), int(cy)
            if 0 <= ix < w and 0 <= iy < h:
                hm[i, lab] = torch.maximum(hm[i, lab], torch.exp(-((xx - ix) ** 2 + (yy - iy) ** 2) / 4.5))
                reg[i, :, iy, ix] = torch.tensor([cx - ix, cy - iy, box[2], np.log(box[3]), np.log(box[4]),
                                                  np.log(box[5]), np.sin(box[6]), np.cos(box[6])], device=device)
                mask[i, iy, ix] = True
    return hm, reg, mask


def bev_iou_proxy(pred_reg, tgt_reg):
    # cheap IoU proxy from center offset and log-size error
    d = (pred_reg[:, :2] - tgt_reg[:, :2]).norm(dim=1) + (pred_reg[:, 3:5] - tgt_reg[:, 3:5]).abs().sum(1)
    return torch.exp(-d)


@torch.no_grad()
def evaluate(net, dataset, dev, rank, world, bs):
    """Center recall@0.3 on val, each rank takes every world-th frame (no padding)."""
    shard = torch.utils.data.Subset(dataset, range(rank, len(dataset), world))
    loader = DataLoader(shard, batch_size=bs, num_workers=2, collate_fn=collate)
    net.eval()
    counts = torch.zeros(2, device=dev)
    for vox, coords, npts, boxes, labels, _ in loader:
        hm, _, iou = net(vox.to(dev), coords.to(dev), npts.to(dev), len(boxes))
        score = hm.sigmoid() * iou.sigmoid()
        _, _, mask = targets(boxes, labels, hm.shape, dev)
        hit = score.max(1)[0][mask] > 0.3
        counts += torch.stack([hit.sum().float(), torch.tensor(float(hit.numel()), device=dev)])
    dist.all_reduce(counts)
    net.train()
    return (counts[0] / counts[1].clamp(min=1)).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    db_file = os.path.join(args.cfg_root, "kitti_dbinfos_train.pkl")
    if rank == 0 and not os.path.exists(db_file):
        with open(os.path.join(args.cfg_root, "kitti_infos_train.pkl"), "rb") as f:
            build_db_infos(args.cfg_root, pickle.load(f), db_file)
    dist.barrier()
    with open(db_file, "rb") as f:
        db_infos = pickle.load(f)

    train_set = KittiDet(args.cfg_root, "train", db_infos)
    val_set = KittiDet(args.cfg_root, "val")
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        collate_fn=collate, drop_last=True, pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(CenterPointIoU(len(CLASSES))).to(dev)
    # the IoU head gets no gradient before iou_start_epoch
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    lr = args.lr * args.batch_size * world / 32
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=args.epochs * len(loader),
                                                pct_start=0.4)

    writer = SummaryWriter(args.out) if rank == 0 else None
    ckpt_path = os.path.join(args.out, "latest.pth")
    start = 0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start = ck["epoch"] + 1

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        use_iou = epoch >= args.iou_start_epoch
        for it, (vox, coords, npts, boxes, labels, _) in enumerate(loader):
            vox, coords, npts = vox.to(dev, non_blocking=True), coords.to(dev), npts.to(dev)
            hm, reg, iou = model(vox, coords, npts, len(boxes))
            hm_t, reg_t, mask = targets(boxes, labels, hm.shape, dev)
            p = hm.sigmoid().clamp(1e-4, 1 - 1e-4)
            pos = hm_t.eq(1).float()
            npos = pos.sum().clamp(min=1)
            l_hm = -((p.log() * (1 - p) ** 2 * pos) + ((1 - p).log() * p ** 2 * (1 - hm_t) ** 4 * (1 - pos))).sum() / npos
            pr, tr = reg.permute(0, 2, 3, 1)[mask], reg_t.permute(0, 2, 3, 1)[mask]
            l_reg = F.l1_loss(pr, tr, reduction="sum") / npos
            loss = l_hm + 2 * l_reg
            if use_iou and pr.numel() > 0:
                iou_t = bev_iou_proxy(pr.detach(), tr)
                l_iou = F.binary_cross_entropy_with_logits(iou.permute(0, 2, 3, 1)[mask].squeeze(-1), iou_t)
                loss = loss + l_iou
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10)
            opt.step()
            sched.step()
            if it % 50 == 0:
                stats = torch.stack([loss.detach(), l_hm.detach(), l_reg.detach()])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                if rank == 0:
                    step = epoch * len(loader) + it
                    for name, v in zip(("loss", "hm", "reg"), stats.tolist()):
                        writer.add_scalar(f"train/{name}", v, step)
                    print(f"[{epoch}/{args.epochs}][{it}/{len(loader)}] loss {stats[0].item():.3f} "
                          f"({time.time() - t0:.0f}s)", flush=True)
        if (epoch + 1) % 5 == 0:
            recall = evaluate(model.module, val_set, dev, rank, world, args.batch_size)
            if rank == 0:
                print(f"epoch {epoch} val center recall {recall:.4f}", flush=True)
                writer.add_scalar("val/center_recall", recall, epoch)
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
