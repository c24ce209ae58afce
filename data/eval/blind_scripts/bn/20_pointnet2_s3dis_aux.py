"""
PointNet++ (SSG) semantic segmentation on S3DIS (test on Area 5) with deep supervision:
an auxiliary classifier on the 1/16-resolution decoder features helps the early
epochs and is switched off once the main head has caught up.

    torchrun --nproc_per_node=4 train_s3dis.py --data_root data/s3dis/trainval_fullarea --log_dir log/pn2_s3dis_aux
"""
import argparse
import glob
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from pointnet2_ops.pointnet2_modules import PointnetFPModule, PointnetSAModule

CLASSES = ["ceiling", "floor", "wall", "beam", "column", "window", "door", "table", "chair", "sofa", "bookcase",
           "board", "clutter"]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_root", default="data/s3dis/trainval_fullarea")
    p.add_argument("--test_area", type=int, default=5)
    p.add_argument("--num_point", type=int, default=4096)
    p.add_argument("--block_size", type=float, default=1.0)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--epochs", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.001)
    p.add_argument("--aux_weight", type=float, default=0.4)
    p.add_argument("--aux_epochs", type=int, default=20)
    p.add_argument("--log_dir", default="log/pn2_s3dis_aux")
    return p.parse_args()


class S3DISBlocks(Dataset):
    """Random 1m x 1m blocks from whole rooms (rooms stored as N x 7: xyz rgb label)."""

    def __init__(self, root, split, test_area, num_point, block_size, blocks_per_room=64):
        rooms = sorted(glob.glob(os.path.join(root, "Area_*.npy")))
        is_test = [f"Area_{test_area}" in os.path.basename(r) for r in rooms]
        self.rooms = [r for r, t in zip(rooms, is_test) if t == (split == "test")]
        self.data = [np.load(r).astype(np.float32) for r in self.rooms]
        self.num_point, self.block_size = num_point, block_size
        self.index = [i for i in range(len(self.rooms)) for _ in range(blocks_per_room)]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, idx):
        room = self.data[self.index[idx]]
        xyz, rgb, lab = room[:, :3], room[:, 3:6], room[:, 6].astype(np.int64)
        room_max = xyz.max(0)
        for _ in range(10):
            center = xyz[np.random.randint(len(xyz))]
            lo, hi = center[:2] - self.block_size / 2, center[:2] + self.block_size / 2
            sel = np.where(np.all((xyz[:, :2] >= lo) & (xyz[:, :2] <= hi), axis=1))[0]
            if len(sel) > 1024:
                break
        sel = np.random.choice(sel, self.num_point, replace=len(sel) < self.num_point)
        pts = np.zeros((self.num_point, 9), np.float32)
        pts[:, :3] = xyz[sel] - np.array([center[0], center[1], 0], np.float32)
        pts[:, 3:6] = rgb[sel] / 255.0
        pts[:, 6:9] = xyz[sel] / room_max
        return torch.from_numpy(pts), torch.from_numpy(lab[sel])


class PointNet2SemSegAux(nn.Module):
    def __init__(self, num_classes=13):
        super().__init__()
        self.sa1 = PointnetSAModule(npoint=1024, radius=0.1, nsample=32, mlp=[6, 32, 32, 64])
        self.sa2 = PointnetSAModule(npoint=256, radius=0.2, nsample=32, mlp=[64, 64, 64, 128])
        self.sa3 = PointnetSAModule(npoint=64, radius=0.4, nsample=32, mlp=[128, 128, 128, 256])
        self.sa4 = PointnetSAModule(npoint=16, radius=0.8, nsample=32, mlp=[256, 256, 256, 512])
        self.fp4 = PointnetFPModule(mlp=[768, 256, 256])
        self.fp3 = PointnetFPModule(mlp=[384, 256, 256])
        self.fp2 = PointnetFPModule(mlp=[320, 256, 128])
        self.fp1 = PointnetFPModule(mlp=[128 + 6, 128, 128, 128])
        self.head = nn.Sequential(nn.Conv1d(128, 128, 1, bias=False), nn.BatchNorm1d(128), nn.ReLU(True),
                                  nn.Dropout(0.5), nn.Conv1d(128, num_classes, 1))
        self.aux_head = nn.Sequential(nn.Conv1d(256, 128, 1, bias=False), nn.BatchNorm1d(128), nn.ReLU(True),
                                      nn.Conv1d(128, num_classes, 1))

    def forward(self, pts):
        xyz = pts[..., :3].contiguous()
        feats = pts[..., 3:].transpose(1, 2).contiguous()
        l1_xyz, l1 = self.sa1(xyz, feats)
        l2_xyz, l2 = self.sa2(l1_xyz, l1)
        l3_xyz, l3 = self.sa3(l2_xyz, l2)
        l4_xyz, l4 = self.sa4(l3_xyz, l3)
        l3 = self.fp4(l3_xyz, l4_xyz, l3, l4)
        l2 = self.fp3(l2_xyz, l3_xyz, l2, l3)
        aux = self.aux_head(l2)                                   # B, C, 256
        l1 = self.fp2(l1_xyz, l2_xyz, l1, l2)
        l0 = self.fp1(xyz, l1_xyz, feats, l1)
        return self.head(l0), aux, l2_xyz


def aux_targets(xyz, labels, l2_xyz):
    # label of the nearest input point for every level-2 center
    nn_idx = torch.cdist(l2_xyz, xyz).argmin(-1)
    return torch.gather(labels, 1, nn_idx)


@torch.no_grad()
def evaluate(model, loader, device, n_cls=13):
    model.eval()
    inter = torch.zeros(n_cls, device=device, dtype=torch.float64)
    union = torch.zeros_like(inter)
    for pts, lab in loader:
        pts, lab = pts.to(device), lab.to(device)
        pred = model(pts)[0].argmax(1)
        for c in range(n_cls):
            inter[c] += ((pred == c) & (lab == c)).sum()
            union[c] += ((pred == c) | (lab == c)).sum()
    dist.all_reduce(inter)
    dist.all_reduce(union)
    model.train()
    return (inter / union.clamp(min=1)).cpu().numpy()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_set = S3DISBlocks(args.data_root, "train", args.test_area, args.num_point, args.block_size)
    test_set = S3DISBlocks(args.data_root, "test", args.test_area, args.num_point, args.block_size, 16)
    sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                              drop_last=True, pin_memory=True)
    test_loader = DataLoader(torch.utils.data.Subset(test_set, range(rank, len(test_set), world)),
                             batch_size=args.batch_size, num_workers=8)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(PointNet2SemSegAux(len(CLASSES))).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * world, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.7)

    writer = SummaryWriter(args.log_dir) if rank == 0 else None
    best_miou, step = 0.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for pts, lab in train_loader:
            pts, lab = pts.to(device, non_blocking=True), lab.to(device, non_blocking=True)
            logits, aux, l2_xyz = model(pts)
            loss = F.cross_entropy(logits, lab)
            if epoch < args.aux_epochs:
                aux_lab = aux_targets(pts[..., :3], lab, l2_xyz)
                loss = loss + args.aux_weight * F.cross_entropy(aux, aux_lab)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if rank == 0 and step % 100 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
        scheduler.step()

        ious = evaluate(model.module, test_loader, device)
        miou = float(ious.mean())
        if rank == 0:
            print(f"epoch {epoch} mIoU {miou:.4f} time {time.time() - t0:.0f}s | " +
                  " ".join(f"{c}:{v:.3f}" for c, v in zip(CLASSES, ious)), flush=True)
            writer.add_scalar("test/mIoU", miou, epoch)
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict()},
                       os.path.join(args.log_dir, "last.pth"))
            if miou > best_miou:
                best_miou = miou
                torch.save(model.module.state_dict(), os.path.join(args.log_dir, "best_model.pth"))
        dist.barrier()

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
