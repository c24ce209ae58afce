"""SECOND-style sparse-conv detector on Waymo (Vehicle / Pedestrian / Cyclist).

Frames are pre-extracted from the tfrecords into
    <root>/waymo_processed_data/<segment>/{0000.npy, ..., labels.pkl}
Usage:
    bash tools/dist_train.sh 8 --root data/waymo --sampled_interval 5
which runs: torchrun --nproc_per_node=8 tools/train_second_waymo.py ...
"""
import argparse
import glob
import logging
import os
import pickle
import time

import numpy as np
import spconv.pytorch as spconv
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

CLASSES = ["Vehicle", "Pedestrian", "Cyclist"]
PC_RANGE = np.array([-75.2, -75.2, -2.0, 75.2, 75.2, 4.0], np.float32)
VOXEL_SIZE = np.array([0.1, 0.1, 0.15], np.float32)
GRID = ((PC_RANGE[3:] - PC_RANGE[:3]) / VOXEL_SIZE).round().astype(np.int64)  # x, y, z
MAX_VOXELS = 150000


class WaymoDataset(Dataset):
    def __init__(self, root, split, training, sampled_interval=1):
        self.root, self.training = root, training
        self.data_dir = os.path.join(root, "waymo_processed_data")
        cache = os.path.join(root, f"waymo_infos_{split}_interval{sampled_interval}.pkl")
        if not os.path.exists(cache):
            infos = self.build_infos(split, sampled_interval)
            with open(cache, "wb") as f:
                pickle.dump(infos, f)
        with open(cache, "rb") as f:
            self.infos = pickle.load(f)

    def build_infos(self, split, interval):
        with open(os.path.join(self.root, "ImageSets", f"{split}.txt")) as f:
            segments = [os.path.splitext(s.strip())[0] for s in f if s.strip()]
        infos = []
        for seg in segments:
            seg_dir = os.path.join(self.data_dir, seg)
            if not os.path.isdir(seg_dir):
                continue
            with open(os.path.join(seg_dir, "labels.pkl"), "rb") as f:
                labels = pickle.load(f)
            frames = sorted(glob.glob(os.path.join(seg_dir, "[0-9]*.npy")))
            for fi, fpath in enumerate(frames[::interval]):
                lab = labels[fi * interval]
                keep = np.isin(lab["name"], CLASSES) & (lab["num_points_in_gt"] > 0)
                infos.append({"lidar_path": os.path.relpath(fpath, self.data_dir),
                              "frame_id": f"{seg}_{fi * interval:03d}",
                              "gt_boxes": lab["gt_boxes_lidar"][keep].astype(np.float32),
                              "gt_names": lab["name"][keep],
                              "difficulty": lab["difficulty"][keep]})
        return infos

    def __len__(self):
        return len(self.infos)

    def __getitem__(self, idx):
        info = self.infos[idx]
        pts = np.load(os.path.join(self.data_dir, info["lidar_path"]))[:, :5].astype(np.float32)
        pts[:, 3] = np.tanh(pts[:, 3])
        boxes = info["gt_boxes"].copy()
        labels = np.array([CLASSES.index(n) for n in info["gt_names"]], np.int64)
        if self.training:
            for axis in (0, 1):
                if np.random.rand() < 0.5:
                    pts[:, 1 - axis] *= -1
                    boxes[:, 1 - axis] *= -1
                    boxes[:, 6] = -boxes[:, 6] if axis == 0 else np.pi - boxes[:, 6]
            s = np.random.uniform(0.95, 1.05)
            pts[:, :3] *= s
            boxes[:, :6] *= s
        m = np.all((pts[:, :3] >= PC_RANGE[:3]) & (pts[:, :3] < PC_RANGE[3:]), 1)
        pts = pts[m]
        coords = ((pts[:, :3] - PC_RANGE[:3]) / VOXEL_SIZE).astype(np.int32)
        uniq, inv = np.unique(coords, axis=0, return_inverse=True)
        inv = inv.reshape(-1)
        feats = np.zeros((len(uniq), 5), np.float32)
        np.add.at(feats, inv, pts)
        feats /= np.bincount(inv)[:, None]
        if self.training and len(uniq) > MAX_VOXELS:
            sel = np.random.choice(len(uniq), MAX_VOXELS, replace=False)
            uniq, feats = uniq[sel], feats[sel]
        return {"voxels": feats, "coords": uniq[:, ::-1].copy(), "gt_boxes": boxes, "gt_labels": labels,
                "frame_id": info["frame_id"]}


def collate_batch(batch):
    coords = [np.pad(b["coords"], ((0, 0), (1, 0)), constant_values=i) for i, b in enumerate(batch)]
    return {"voxels": torch.from_numpy(np.concatenate([b["voxels"] for b in batch])),
            "coords": torch.from_numpy(np.concatenate(coords)).int(),
            "gt_boxes": [torch.from_numpy(b["gt_boxes"]) for b in batch],
            "gt_labels": [torch.from_numpy(b["gt_labels"]) for b in batch],
            "frame_id": [b["frame_id"] for b in batch], "batch_size": len(batch)}


def sp_block(cin, cout, key, stride=1, subm=True):
    conv = (spconv.SubMConv3d(cin, cout, 3, padding=1, bias=False, indice_key=key) if subm else
            spconv.SparseConv3d(cin, cout, 3, stride=stride, padding=1, bias=False, indice_key=key))
    return spconv.SparseSequential(conv, nn.BatchNorm1d(cout, eps=1e-3, momentum=0.01), nn.ReLU())


class SECONDCenter(nn.Module):
    def __init__(self, num_classes=3):
        super().__init__()
        self.sparse_shape = GRID[::-1].tolist()  # z, y, x
        self.conv_input = sp_block(5, 16, "subm1")
        self.conv1 = sp_block(16, 16, "subm1")
        self.conv2 = spconv.SparseSequential(sp_block(16, 32, "spconv2", 2, False), sp_block(32, 32, "subm2"))
        self.conv3 = spconv.SparseSequential(sp_block(32, 64, "spconv3", 2, False), sp_block(64, 64, "subm3"))
        self.conv4 = spconv.SparseSequential(sp_block(64, 64, "spconv4", 2, False), sp_block(64, 64, "subm4"))
        self.conv_out = spconv.SparseSequential(
            spconv.SparseConv3d(64, 128, (3, 1, 1), stride=(2, 1, 1), bias=False, indice_key="out"),
            nn.BatchNorm1d(128, eps=1e-3, momentum=0.01), nn.ReLU())
        self.bev = nn.Sequential(nn.Conv2d(128 * 3, 256, 3, 1, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU(),
                                 nn.Conv2d(256, 256, 3, 1, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU())
        self.hm = nn.Conv2d(256, num_classes, 1)
        self.reg = nn.Conv2d(256, 8, 1)
        nn.init.constant_(self.hm.bias, -2.19)

    def forward(self, voxels, coords, batch_size):
        x = spconv.SparseConvTensor(voxels, coords, self.sparse_shape, batch_size)
        x = self.conv_out(self.conv4(self.conv3(self.conv2(self.conv1(self.conv_input(x))))))
        dense = x.dense()
        N, C, D, H, W = dense.shape
        f = self.bev(dense.view(N, C * D, H, W))
        return self.hm(f), self.reg(f)


def center_targets(boxes_list, labels_list, shape, device, stride=8):
    B = len(boxes_list)
    H, W = shape
    hm = torch.zeros(B, len(CLASSES), H, W, device=device)
    inds, regs, bids = [], [], []
    ys, xs = torch.meshgrid(torch.arange(H, device=device), torch.arange(W, device=device), indexing="ij")
    for b in range(B):
        bx, lb = boxes_list[b].to(device), labels_list[b].to(device)
        fx = (bx[:, 0] - PC_RANGE[0]) / VOXEL_SIZE[0] / stride
        fy = (bx[:, 1] - PC_RANGE[1]) / VOXEL_SIZE[1] / stride
        ok = (fx >= 0) & (fx < W) & (fy >= 0) & (fy < H)
        for k in torch.nonzero(ok).flatten().tolist():
            ix, iy = int(fx[k]), int(fy[k])
            sigma = max(0.8, float(bx[k, 3:5].min()) / VOXEL_SIZE[0] / stride / 3)
            g = torch.exp(-((xs - ix) ** 2 + (ys - iy) ** 2) / (2 * sigma ** 2))
            hm[b, lb[k]] = torch.maximum(hm[b, lb[k]], g)
            inds.append(iy * W + ix)
            bids.append(b)
            regs.append(torch.stack([fx[k] - ix, fy[k] - iy, bx[k, 2], *bx[k, 3:6].log(),
                                     bx[k, 6].sin(), bx[k, 6].cos()]))
    if regs:
        return hm, torch.tensor(bids, device=device), torch.tensor(inds, device=device), torch.stack(regs)
    return hm, None, None, None


def det_loss(hm_pred, reg_pred, targets):
    hm, bids, inds, regs = targets
    p = hm_pred.sigmoid().clamp(1e-4, 1 - 1e-4)
    pos = hm.eq(1).float()
    l_hm = -(pos * (1 - p) ** 2 * p.log() + (1 - pos) * (1 - hm) ** 4 * p ** 2 * (1 - p).log()).sum()
    l_hm = l_hm / pos.sum().clamp(min=1)
    if bids is None:
        return l_hm + 0.0 * reg_pred.sum(), l_hm.detach(), torch.zeros((), device=hm.device)
    pr = reg_pred.flatten(2)[bids, :, inds]
    l_reg = F.smooth_l1_loss(pr, regs, beta=1 / 9)
    return l_hm + 2.0 * l_reg, l_hm.detach(), l_reg.detach()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="data/waymo")
    ap.add_argument("--sampled_interval", type=int, default=5)
    ap.add_argument("--batch_size", type=int, default=2, help="per GPU")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--output", default="output/second_waymo")
    ap.add_argument("--ckpt_interval", type=int, default=2)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    logger = logging.getLogger("second")
    device = torch.device("cuda", local_rank)

    train_set = WaymoDataset(args.root, "train", True, args.sampled_interval)
    logger.info("train frames: %d", len(train_set))
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        collate_fn=collate_batch, pin_memory=True, drop_last=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(SECONDCenter(len(CLASSES))).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.99))
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, total_steps=args.epochs * len(loader),
                                                    pct_start=0.4, div_factor=10)

    start_epoch = 0
    last = os.path.join(args.output, "ckpt", "latest_model.pth")
    if os.path.exists(last):
        ck = torch.load(last, map_location="cpu")
        model.module.load_state_dict(ck["model_state"])
        optimizer.load_state_dict(ck["optimizer_state"])
        scheduler.load_state_dict(ck["scheduler_state"])
        start_epoch = ck["epoch"] + 1
        logger.info("resumed from epoch %d", ck["epoch"])

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, batch in enumerate(loader):
            voxels = batch["voxels"].to(device, non_blocking=True)
            coords = batch["coords"].to(device, non_blocking=True)
            hm, reg = model(voxels, coords, batch["batch_size"])
            targets = center_targets(batch["gt_boxes"], batch["gt_labels"], hm.shape[-2:], device)
            loss, l_hm, l_reg = det_loss(hm, reg, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            optimizer.step()
            scheduler.step()
            if it % 100 == 0:
                logger.info("epoch %d it %d/%d loss %.4f hm %.4f reg %.4f lr %.2e %.1fs", epoch, it, len(loader),
                            loss.item(), l_hm.item(), l_reg.item(), scheduler.get_last_lr()[0], time.time() - t0)

        if rank == 0 and ((epoch + 1) % args.ckpt_interval == 0 or epoch + 1 == args.epochs):
            os.makedirs(os.path.dirname(last), exist_ok=True)
            state = {"model_state": model.module.state_dict(), "optimizer_state": optimizer.state_dict(),
                     "scheduler_state": scheduler.state_dict(), "epoch": epoch}
            torch.save(state, os.path.join(args.output, "ckpt", f"checkpoint_epoch_{epoch + 1}.pth"))
            torch.save(state, last)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
