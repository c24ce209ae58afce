"""
SECOND-style voxel detector (spconv 2.x) on KITTI, center-heatmap head.

    torchrun --nproc_per_node=4 tools/train_second.py --data_root data/kitti \
        --batch_size 4 --epochs 80 --out_dir output/second_center
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

import spconv.pytorch as spconv
from spconv.pytorch.utils import PointToVoxel

PC_RANGE = [0.0, -40.0, -3.0, 70.4, 40.0, 1.0]
VOXEL_SIZE = [0.05, 0.05, 0.1]
CLASS_NAMES = ["Car", "Pedestrian", "Cyclist"]
OUT_STRIDE = 8


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_root", default="data/kitti")
    p.add_argument("--batch_size", type=int, default=4, help="per GPU")
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--lr", type=float, default=0.003, help="for 8 samples, scaled linearly")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--out_dir", default="output/second_center")
    p.add_argument("--resume", default="")
    p.add_argument("--eval_every", type=int, default=5)
    return p.parse_args()


class KittiVoxels(Dataset):
    def __init__(self, root, split, training):
        with open(os.path.join(root, f"kitti_infos_{split}.pkl"), "rb") as f:
            self.infos = pickle.load(f)
        self.root = root
        self.training = training
        self.voxel_gen = PointToVoxel(vsize_xyz=VOXEL_SIZE, coors_range_xyz=PC_RANGE,
                                      num_point_features=4, max_num_points_per_voxel=5,
                                      max_num_voxels=16000 if training else 40000)

    def __len__(self):
        return len(self.infos)

    def _augment(self, pts, boxes):
        if np.random.rand() < 0.5:  # flip along x
            pts[:, 1] = -pts[:, 1]
            boxes[:, 1] = -boxes[:, 1]
            boxes[:, 6] = -boxes[:, 6]
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
        frame = info["point_cloud"]["lidar_idx"]
        pts = np.fromfile(os.path.join(self.root, "training", "velodyne", f"{frame}.bin"),
                          dtype=np.float32).reshape(-1, 4)
        annos = info["annos"]
        keep = np.isin(annos["name"], CLASS_NAMES)
        boxes = annos["gt_boxes_lidar"][keep].astype(np.float32)
        labels = np.array([CLASS_NAMES.index(n) + 1 for n in annos["name"][keep]], dtype=np.float32)
        if self.training:
            pts, boxes = self._augment(pts, boxes)
        voxels, coords, npts = self.voxel_gen(torch.from_numpy(pts))
        gt = np.concatenate([boxes, labels[:, None]], axis=1) if len(boxes) else np.zeros((0, 8), np.float32)
        return dict(voxels=voxels, coords=coords, npts=npts, gt=torch.from_numpy(gt), frame_id=frame)


def collate_voxels(batch):
    out = {"frame_id": [b["frame_id"] for b in batch]}
    out["voxels"] = torch.cat([b["voxels"] for b in batch])
    out["npts"] = torch.cat([b["npts"] for b in batch])
    out["coords"] = torch.cat([F.pad(b["coords"], (1, 0), value=i) for i, b in enumerate(batch)])
    max_gt = max(1, max(len(b["gt"]) for b in batch))
    gt = torch.zeros(len(batch), max_gt, 8)
    for i, b in enumerate(batch):
        gt[i, :len(b["gt"])] = b["gt"]
    out["gt"] = gt
    out["batch_size"] = len(batch)
    return out


def block(cin, cout, key, stride=1, subm=True):
    conv = (spconv.SubMConv3d(cin, cout, 3, padding=1, bias=False, indice_key=key) if subm else
            spconv.SparseConv3d(cin, cout, 3, stride=stride, padding=1, bias=False, indice_key=key))
    return spconv.SparseSequential(conv, nn.BatchNorm1d(cout, eps=1e-3, momentum=0.01), nn.ReLU())


class SecondCenter(nn.Module):
    def __init__(self, num_classes=3):
        super().__init__()
        grid = (np.array(PC_RANGE[3:]) - np.array(PC_RANGE[:3])) / np.array(VOXEL_SIZE)
        self.sparse_shape = [int(round(grid[2])) + 1, int(round(grid[1])), int(round(grid[0]))]
        self.backbone3d = spconv.SparseSequential(
            block(4, 16, "subm1"), block(16, 16, "subm1"),
            block(16, 32, "spconv2", 2, False), block(32, 32, "subm2"),
            block(32, 64, "spconv3", 2, False), block(64, 64, "subm3"),
            block(64, 64, "spconv4", 2, False), block(64, 64, "subm4"),
            spconv.SparseConv3d(64, 128, (3, 1, 1), stride=(2, 1, 1), bias=False, indice_key="out"),
            nn.BatchNorm1d(128, eps=1e-3, momentum=0.01), nn.ReLU())
        self.bev = nn.Sequential(
            nn.Conv2d(128 * 2, 128, 3, padding=1, bias=False), nn.BatchNorm2d(128), nn.ReLU(),
            nn.Conv2d(128, 128, 3, padding=1, bias=False), nn.BatchNorm2d(128), nn.ReLU())
        self.heatmap = nn.Conv2d(128, num_classes, 1)
        self.reg = nn.Conv2d(128, 8, 1)  # dx, dy, z, log l/w/h, sin, cos
        nn.init.constant_(self.heatmap.bias, -2.19)
        self.num_classes = num_classes

    def forward(self, batch):
        feats = batch["voxels"].sum(1) / batch["npts"].clamp(min=1).unsqueeze(-1).type_as(batch["voxels"])
        x = spconv.SparseConvTensor(feats, batch["coords"].int(), self.sparse_shape, batch["batch_size"])
        x = self.backbone3d(x).dense()
        n, c, d, h, w = x.shape
        x = self.bev(x.view(n, c * d, h, w))
        return {"hm": self.heatmap(x), "reg": self.reg(x)}

    def build_targets(self, gt, hm_shape):
        b, _, h, w = hm_shape
        hm = gt.new_zeros(b, self.num_classes, h, w)
        reg = gt.new_zeros(b, 8, h, w)
        mask = gt.new_zeros(b, h, w)
        cell = VOXEL_SIZE[0] * OUT_STRIDE
        for i in range(b):
            for box in gt[i]:
                if box[7] <= 0:
                    continue
                cx = (box[0] - PC_RANGE[0]) / cell
                cy = (box[1] - PC_RANGE[1]) / cell
                ix, iy = int(cx), int(cy)
                if not (0 <= ix < w and 0 <= iy < h):
                    continue
                cls = int(box[7]) - 1
                ys = torch.arange(h, device=gt.device).view(-1, 1).float()
                xs = torch.arange(w, device=gt.device).view(1, -1).float()
                g = torch.exp(-((xs - ix) ** 2 + (ys - iy) ** 2) / (2 * 1.5 ** 2))
                hm[i, cls] = torch.maximum(hm[i, cls], g)
                reg[i, :, iy, ix] = torch.stack([cx - ix, cy - iy, box[2], box[3].log(), box[4].log(),
                                                 box[5].log(), box[6].sin(), box[6].cos()])
                mask[i, iy, ix] = 1
        return hm, reg, mask

    def get_training_loss(self, preds, batch):
        hm_t, reg_t, mask = self.build_targets(batch["gt"], preds["hm"].shape)
        pred = preds["hm"].sigmoid().clamp(1e-4, 1 - 1e-4)
        pos = hm_t.eq(1).float()
        neg_w = (1 - hm_t) ** 4
        pos_loss = (torch.log(pred) * (1 - pred) ** 2 * pos).sum()
        neg_loss = (torch.log(1 - pred) * pred ** 2 * neg_w * (1 - pos)).sum()
        num_pos = pos.sum().clamp(min=1)
        hm_loss = -(pos_loss + neg_loss) / num_pos
        reg_loss = (F.l1_loss(preds["reg"], reg_t, reduction="none") * mask.unsqueeze(1)).sum() / num_pos
        loss = hm_loss + 2.0 * reg_loss
        return loss, {"hm_loss": hm_loss.item(), "reg_loss": reg_loss.item()}


def to_device(batch, device):
    return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}


@torch.no_grad()
def evaluate(model, dataset, device, rank, world_size, batch_size):
    # every rank decodes its own slice, rank 0 computes AP over all frames
    shard = Subset(dataset, list(range(rank, len(dataset), world_size)))
    loader = DataLoader(shard, batch_size=batch_size, num_workers=2, collate_fn=collate_voxels)
    model.eval()
    dets = []
    for batch in loader:
        batch = to_device(batch, device)
        preds = model(batch)
        scores, _ = preds["hm"].sigmoid().flatten(2).max(1)
        topk = scores.topk(100, dim=1)
        for i, fid in enumerate(batch["frame_id"]):
            dets.append({"frame_id": fid, "scores": topk.values[i].cpu().numpy(),
                         "idx": topk.indices[i].cpu().numpy()})
    gathered = [None] * world_size
    dist.all_gather_object(gathered, dets)
    model.train()
    if rank != 0:
        return None
    all_dets = [d for part in gathered for d in part]
    mean_score = float(np.mean([d["scores"][:10].mean() for d in all_dets]))
    return {"num_frames": len(all_dets), "mean_top10_score": mean_score}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")
    log = logging.getLogger("second")
    writer = SummaryWriter(os.path.join(args.out_dir, "tb")) if rank == 0 else None
    if rank == 0:
        os.makedirs(os.path.join(args.out_dir, "ckpt"), exist_ok=True)

    train_set = KittiVoxels(args.data_root, "train", training=True)
    val_set = KittiVoxels(args.data_root, "val", training=False)
    sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        collate_fn=collate_voxels, pin_memory=True, drop_last=True)

    model = SecondCenter(num_classes=len(CLASS_NAMES))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    lr = args.lr * args.batch_size * world_size / 8
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    total_steps = args.epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=total_steps,
                                                    pct_start=0.4, div_factor=10)
    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1

    step = start_epoch * len(loader)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, batch in enumerate(loader):
            batch = to_device(batch, device)
            preds = model(batch)
            loss, tb_dict = model.get_training_loss(preds, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if rank == 0 and it % 50 == 0:
                log.info(f"ep {epoch} it {it}/{len(loader)} loss {loss.item():.4f} "
                         f"lr {scheduler.get_last_lr()[0]:.2e} {time.time() - t0:.1f}s")
                writer.add_scalar("train/loss", loss.item(), step)
                for k, v in tb_dict.items():
                    writer.add_scalar(f"train/{k}", v, step)

        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch},
                       os.path.join(args.out_dir, "ckpt", f"checkpoint_epoch_{epoch + 1}.pth"))
        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            res = evaluate(model.module, val_set, device, rank, world_size, args.batch_size)
            if rank == 0:
                log.info(f"eval ep {epoch}: {res}")
                writer.add_scalar("val/mean_top10_score", res["mean_top10_score"], epoch)
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
