#!/usr/bin/env python
"""PointNet++ (SSG, pure PyTorch) classification on ModelNet40, multi-node DDP.

    sbatch -N 2 --ntasks-per-node=4 --gres=gpu:4 -c 6 -t 04:00:00 run_pointnet.sh

run_pointnet.sh:
    export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1)
    export MASTER_PORT=12802
    srun python pointnet_modelnet.py --h5-dir /data/shared/modelnet40_ply_hdf5_2048 \
        --log-dir /home/$USER/experiments/pointnet2
"""
import argparse
import glob
import logging
import os
import sys

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


class ModelNet40H5(Dataset):
    def __init__(self, h5_dir, split, n_points=1024, augment=False):
        files = sorted(glob.glob(os.path.join(h5_dir, f"ply_data_{split}*.h5")))
        pts, lbl = [], []
        for f in files:
            with h5py.File(f, "r") as h:
                pts.append(h["data"][:].astype(np.float32))
                lbl.append(h["label"][:].astype(np.int64).reshape(-1))
        self.points = np.concatenate(pts)
        self.labels = np.concatenate(lbl)
        self.n_points, self.augment = n_points, augment

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        p = self.points[i][: self.n_points].copy()
        if self.augment:
            p = p * np.random.uniform(0.8, 1.25, size=(1, 3)).astype(np.float32)
            p = p + np.random.uniform(-0.1, 0.1, size=(1, 3)).astype(np.float32)
            np.random.shuffle(p)
        return torch.from_numpy(p), int(self.labels[i])


def square_distance(a, b):
    return torch.cdist(a, b) ** 2


def farthest_point_sample(xyz, n):
    B, N, _ = xyz.shape
    idx = torch.zeros(B, n, dtype=torch.long, device=xyz.device)
    dist_ = torch.full((B, N), 1e10, device=xyz.device)
    far = torch.randint(0, N, (B,), device=xyz.device)
    ar = torch.arange(B, device=xyz.device)
    for i in range(n):
        idx[:, i] = far
        c = xyz[ar, far].unsqueeze(1)
        dist_ = torch.minimum(dist_, ((xyz - c) ** 2).sum(-1))
        far = dist_.argmax(-1)
    return idx


def gather(points, idx):
    B = points.shape[0]
    ar = torch.arange(B, device=points.device).view(B, *([1] * (idx.dim() - 1)))
    return points[ar, idx]


class SetAbstraction(nn.Module):
    def __init__(self, npoint, radius, nsample, cin, mlp):
        super().__init__()
        self.npoint, self.radius, self.nsample = npoint, radius, nsample
        layers, c = [], cin + 3
        for co in mlp:
            layers += [nn.Conv2d(c, co, 1), nn.BatchNorm2d(co), nn.ReLU(inplace=True)]
            c = co
        self.mlp = nn.Sequential(*layers)

    def forward(self, xyz, feats):
        if self.npoint is None:
            grouped = xyz.unsqueeze(1)
            g_feats = feats.unsqueeze(1) if feats is not None else None
            new_xyz = None
        else:
            new_xyz = gather(xyz, farthest_point_sample(xyz, self.npoint))
            d = square_distance(new_xyz, xyz)
            nn_idx = d.argsort(-1)[..., : self.nsample]
            nn_d = torch.gather(d, 2, nn_idx)
            nn_idx[nn_d > self.radius ** 2] = nn_idx[..., :1].expand_as(nn_idx)[nn_d > self.radius ** 2]
            grouped = gather(xyz, nn_idx) - new_xyz.unsqueeze(2)
            g_feats = gather(feats, nn_idx) if feats is not None else None
        x = grouped if g_feats is None else torch.cat([grouped, g_feats], -1)
        x = self.mlp(x.permute(0, 3, 2, 1))             # B, C, nsample, npoint
        return new_xyz, x.max(2).values.transpose(1, 2)


class PointNet2(nn.Module):
    def __init__(self, num_classes=40):
        super().__init__()
        self.sa1 = SetAbstraction(512, 0.2, 32, 0, [64, 64, 128])
        self.sa2 = SetAbstraction(128, 0.4, 64, 128, [128, 128, 256])
        self.sa3 = SetAbstraction(None, None, None, 256, [256, 512, 1024])
        self.head = nn.Sequential(nn.Linear(1024, 512), nn.BatchNorm1d(512), nn.ReLU(True),
                                  nn.Dropout(0.4), nn.Linear(512, 256), nn.BatchNorm1d(256),
                                  nn.ReLU(True), nn.Dropout(0.4), nn.Linear(256, num_classes))

    def forward(self, xyz):
        l1_xyz, l1 = self.sa1(xyz, None)
        l2_xyz, l2 = self.sa2(l1_xyz, l1)
        _, l3 = self.sa3(l2_xyz, l2)
        return self.head(l3.squeeze(1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--h5-dir", required=True)
    ap.add_argument("--log-dir", required=True)
    ap.add_argument("--epochs", type=int, default=250)
    ap.add_argument("--batch-size", type=int, default=24, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()

    rank = int(os.environ["SLURM_PROCID"])
    world = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, stream=sys.stdout,
                        format="%(asctime)s %(message)s")
    log = logging.getLogger(__name__)

    train_ds = ModelNet40H5(args.h5_dir, "train", augment=True)
    test_ds = ModelNet40H5(args.h5_dir, "test")
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=4,
                          drop_last=True, pin_memory=True)
    test_dl = DataLoader(Subset(test_ds, range(rank, len(test_ds), world)), 32, num_workers=4)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(PointNet2()).cuda()
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world / 8, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.7)

    if rank == 0:
        os.makedirs(args.log_dir, exist_ok=True)
    ckpt_file = os.path.join(args.log_dir, "ckpt.pth")
    start, best = 0, 0.0
    if os.path.exists(ckpt_file):
        ck = torch.load(ckpt_file, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start, best = ck["epoch"] + 1, ck["best"]

    for epoch in range(start, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for pts, y in train_dl:
            pts, y = pts.cuda(non_blocking=True), y.cuda(non_blocking=True)
            loss = F.cross_entropy(model(pts), y, label_smoothing=0.2)
            opt.zero_grad()
            loss.backward()
            opt.step()
        sched.step()

        model.eval()
        correct = np.zeros(40)
        seen = np.zeros(40)
        loss_sum = 0.0
        with torch.no_grad():
            for pts, y in test_dl:
                pts, y = pts.cuda(), y.cuda()
                logits = model.module(pts)
                loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
                pred = logits.argmax(1)
                for c in range(40):
                    m = y == c
                    seen[c] += m.sum().item()
                    correct[c] += (pred[m] == c).sum().item()
        stats = torch.from_numpy(np.concatenate([correct, seen, [loss_sum]]))
        dist.all_reduce(stats, op=dist.ReduceOp.SUM)
        stats = stats.numpy()
        correct, seen, loss_sum = stats[:40], stats[40:80], stats[80]
        inst_acc = correct.sum() / seen.sum()
        class_acc = np.mean(correct / np.maximum(seen, 1))

        log.info("epoch %d  test loss %.4f  inst acc %.4f  class acc %.4f", epoch,
                 loss_sum / seen.sum(), inst_acc, class_acc)
        if rank == 0:
            if inst_acc > best:
                best = inst_acc
                torch.save(model.module.state_dict(), os.path.join(args.log_dir, "best_model.pth"))
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "best": best}, ckpt_file)
        dist.barrier()

    log.info("best instance accuracy %.4f", best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
