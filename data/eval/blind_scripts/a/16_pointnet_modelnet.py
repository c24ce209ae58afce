"""PointNet classification on ModelNet40 (HDF5 release, 2048 points per shape).

    python -m torch.distributed.launch --nproc_per_node=4 train_pointnet.py --data data/modelnet40_ply_hdf5_2048
    (or: torchrun --nproc_per_node=4 train_pointnet.py ...)
"""
import argparse
import glob
import os

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def load_h5(files):
    pts, labels = [], []
    for f in sorted(files):
        with h5py.File(f, "r") as h:
            pts.append(h["data"][:].astype(np.float32))
            labels.append(h["label"][:].astype(np.int64).reshape(-1))
    return np.concatenate(pts), np.concatenate(labels)


class ModelNet40(Dataset):
    def __init__(self, root, split, num_points=1024, augment=False):
        self.points, self.labels = load_h5(glob.glob(os.path.join(root, f"ply_data_{split}*.h5")))
        self.num_points, self.augment = num_points, augment

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        pts = self.points[i][: self.num_points].copy()
        if self.augment:
            pts = pts * np.random.uniform(2 / 3, 3 / 2, size=3) + np.random.uniform(-0.2, 0.2, size=3)
            pts = pts + np.clip(0.01 * np.random.randn(*pts.shape), -0.05, 0.05)
            np.random.shuffle(pts)
        return torch.from_numpy(pts.astype(np.float32)).T, self.labels[i]


class TNet(nn.Module):
    def __init__(self, k):
        super().__init__()
        self.k = k
        self.convs = nn.Sequential(nn.Conv1d(k, 64, 1), nn.BatchNorm1d(64), nn.ReLU(),
                                   nn.Conv1d(64, 128, 1), nn.BatchNorm1d(128), nn.ReLU(),
                                   nn.Conv1d(128, 1024, 1), nn.BatchNorm1d(1024), nn.ReLU())
        self.fc = nn.Sequential(nn.Linear(1024, 512), nn.BatchNorm1d(512), nn.ReLU(),
                                nn.Linear(512, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, k * k))
        nn.init.zeros_(self.fc[-1].weight)
        nn.init.zeros_(self.fc[-1].bias)

    def forward(self, x):
        m = self.fc(self.convs(x).max(dim=2).values).view(-1, self.k, self.k)
        return m + torch.eye(self.k, device=x.device)


class PointNet(nn.Module):
    def __init__(self, num_classes=40):
        super().__init__()
        self.tnet3 = TNet(3)
        self.conv1 = nn.Sequential(nn.Conv1d(3, 64, 1), nn.BatchNorm1d(64), nn.ReLU())
        self.tnet64 = TNet(64)
        self.conv2 = nn.Sequential(nn.Conv1d(64, 128, 1), nn.BatchNorm1d(128), nn.ReLU(),
                                   nn.Conv1d(128, 1024, 1), nn.BatchNorm1d(1024))
        self.head = nn.Sequential(nn.Linear(1024, 512), nn.BatchNorm1d(512), nn.ReLU(),
                                  nn.Linear(512, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Dropout(0.3),
                                  nn.Linear(256, num_classes))

    def forward(self, x):
        x = torch.bmm(self.tnet3(x), x)
        x = self.conv1(x)
        t64 = self.tnet64(x)
        x = torch.bmm(t64, x)
        x = self.conv2(x).max(dim=2).values
        return self.head(x), t64


def feature_transform_reg(t):
    eye = torch.eye(t.size(1), device=t.device)[None]
    return ((t @ t.transpose(1, 2) - eye) ** 2).sum(dim=(1, 2)).mean()


def seed_worker(worker_id):
    # torch gives every worker its own seed; reuse it for numpy augmentations
    np.random.seed(torch.initial_seed() % 2 ** 32)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--epochs", type=int, default=250)
    p.add_argument("--batch-size", type=int, default=32, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3, help="for a global batch of 32")
    p.add_argument("--num-points", type=int, default=1024)
    p.add_argument("--ckpt", default="pointnet_cls.pth")
    # the old launcher passes --local_rank / --local-rank; torchrun sets LOCAL_RANK instead
    p.add_argument("--local_rank", "--local-rank", type=int, default=None)
    args = p.parse_args()
    if args.local_rank is None:
        args.local_rank = int(os.environ.get("LOCAL_RANK", 0))
    return args


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    np.random.seed(1234 + rank)  # different augmentation per process
    torch.manual_seed(1234)

    train_ds = ModelNet40(args.data, "train", args.num_points, augment=True)
    test_ds = ModelNet40(args.data, "test", args.num_points)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                              drop_last=True, pin_memory=True, worker_init_fn=seed_worker)
    # test set: each rank takes a contiguous block, no duplicated shapes
    per = (len(test_ds) + world - 1) // world
    test_part = torch.utils.data.Subset(test_ds, range(rank * per, min(len(test_ds), (rank + 1) * per)))
    test_loader = DataLoader(test_part, batch_size=64, num_workers=4)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(PointNet()).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * world, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.7)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tot = torch.zeros(3, device=device)
        for pts, label in train_loader:
            pts, label = pts.to(device, non_blocking=True), label.to(device, non_blocking=True)
            logits, t64 = model(pts)
            loss = F.cross_entropy(logits, label, label_smoothing=0.2) + 1e-3 * feature_transform_reg(t64)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            tot += torch.stack([loss.detach() * label.size(0), (logits.argmax(1) == label).sum().float(),
                                torch.tensor(float(label.size(0)), device=device)])
        scheduler.step()
        dist.all_reduce(tot)

        model.eval()
        ev = torch.zeros(2, device=device)
        with torch.no_grad():
            for pts, label in test_loader:
                logits, _ = model.module(pts.to(device))
                ev[0] += (logits.argmax(1) == label.to(device)).sum()
                ev[1] += label.size(0)
        dist.all_reduce(ev)
        acc = (ev[0] / ev[1]).item()
        if rank == 0:
            print(f"epoch {epoch}: loss {(tot[0] / tot[2]).item():.4f} train acc {(tot[1] / tot[2]).item():.4f} "
                  f"test acc {acc:.4f}", flush=True)
            if acc > best:
                best = acc
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "acc": acc}, args.ckpt)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
