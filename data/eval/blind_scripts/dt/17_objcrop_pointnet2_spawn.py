"""PointNet++ (SSG) classifier on lidar object crops from the nuScenes GT database.

Used as the second-stage class verifier on top of the detector. Crops have a variable number of points, padded in the collate and
masked in the network. Started with mp.spawn so it runs the same way on the
workstation and inside the batch-job wrapper:

    python train_objcrop_cls.py --gpus 4 --db data/nuscenes/nuscenes_dbinfos_train.pkl \
        --db-root data/nuscenes --out ckpt/objcrop_pn2
"""
import argparse
import os
import pickle
import socket
from collections import Counter

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

CLASSES = ["car", "truck", "construction_vehicle", "bus", "trailer", "barrier",
           "motorcycle", "bicycle", "pedestrian", "traffic_cone"]
MAX_POINTS = 1024


class ObjectCrops(Dataset):
    def __init__(self, db_file, db_root, split, val_every=10, min_points=5):
        with open(db_file, "rb") as f:
            dbinfos = pickle.load(f)
        items = [(name, d) for name, lst in sorted(dbinfos.items()) if name in CLASSES
                 for d in lst if d["num_points_in_gt"] >= min_points]
        # deterministic split by position: identical on every process
        self.items = [it for i, it in enumerate(items) if (i % val_every == 0) == (split == "val")]
        self.db_root = db_root
        self.train = split == "train"

    def __len__(self):
        return len(self.items)

    def class_counts(self):
        c = Counter(name for name, _ in self.items)
        return [c.get(n, 0) for n in CLASSES]

    def __getitem__(self, i):
        name, d = self.items[i]
        pts = np.fromfile(os.path.join(self.db_root, d["path"]), np.float32).reshape(-1, 5)
        box = d["box3d_lidar"]
        # canonical frame: box center at origin, heading along +x
        pts[:, :3] -= box[:3]
        c, s = np.cos(-box[6]), np.sin(-box[6])
        pts[:, :2] = pts[:, :2] @ np.array([[c, -s], [s, c]], np.float32).T
        pts[:, :3] /= np.maximum(box[3:6], 0.1)
        if self.train:
            pts[:, :3] += np.random.normal(0, 0.01, size=(len(pts), 3)).astype(np.float32)
            if np.random.rand() < 0.5:
                pts[:, 1] = -pts[:, 1]
        if len(pts) > MAX_POINTS:
            pts = pts[np.random.choice(len(pts), MAX_POINTS, replace=False)]
        extra = np.array([*box[3:6], len(pts) / MAX_POINTS], np.float32)
        return torch.from_numpy(pts), torch.from_numpy(extra), CLASSES.index(name)


def pad_collate(batch):
    n = max(p.shape[0] for p, _, _ in batch)
    pts = torch.zeros(len(batch), n, batch[0][0].shape[1])
    mask = torch.zeros(len(batch), n, dtype=torch.bool)
    for i, (p, _, _) in enumerate(batch):
        pts[i, : len(p)] = p
        mask[i, : len(p)] = True
    extra = torch.stack([e for _, e, _ in batch])
    labels = torch.tensor([l for _, _, l in batch])
    return pts, mask, extra, labels


def knn_group(xyz, centers, feats, k, mask):
    d = torch.cdist(centers, xyz)
    d = d.masked_fill(~mask[:, None, :], float("inf"))
    idx = d.topk(k, dim=-1, largest=False).indices  # B, M, k
    B = xyz.shape[0]
    bidx = torch.arange(B, device=xyz.device)[:, None, None]
    grouped_xyz = xyz[bidx, idx] - centers[:, :, None]
    valid = mask[bidx, idx]
    grouped = torch.cat([grouped_xyz, feats[bidx, idx]], -1) if feats is not None else grouped_xyz
    return grouped, valid


class SetAbstraction(nn.Module):
    def __init__(self, npoint, k, cin, mlp):
        super().__init__()
        self.npoint, self.k = npoint, k
        layers, c = [], cin + 3
        for cout in mlp:
            layers += [nn.Conv2d(c, cout, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(True)]
            c = cout
        self.mlp = nn.Sequential(*layers)

    def forward(self, xyz, feats, mask):
        B, N, _ = xyz.shape
        # random subset of valid points as centers (cheap replacement for FPS on small crops)
        scores = torch.rand(B, N, device=xyz.device).masked_fill(~mask, -1.0)
        cidx = scores.topk(min(self.npoint, N), dim=1).indices
        bidx = torch.arange(B, device=xyz.device)[:, None]
        centers, cmask = xyz[bidx, cidx], mask[bidx, cidx]
        grouped, valid = knn_group(xyz, centers, feats, min(self.k, N), mask)
        x = self.mlp(grouped.permute(0, 3, 1, 2))  # B, C, M, k
        x = x.masked_fill(~valid[:, None], -1e4).max(-1)[0].transpose(1, 2)
        return centers, x, cmask


class PointNet2Cls(nn.Module):
    def __init__(self, in_feats=2, num_classes=len(CLASSES)):
        super().__init__()
        self.sa1 = SetAbstraction(256, 32, in_feats, [64, 64, 128])
        self.sa2 = SetAbstraction(64, 32, 128, [128, 128, 256])
        self.global_mlp = nn.Sequential(nn.Linear(256 + 3, 512), nn.BatchNorm1d(512), nn.ReLU(True),
                                        nn.Linear(512, 512), nn.BatchNorm1d(512), nn.ReLU(True))
        self.cls = nn.Sequential(nn.Dropout(0.4), nn.Linear(512 + 4, 256), nn.ReLU(True), nn.Linear(256, num_classes))

    def forward(self, pts, mask, extra):
        xyz, feats = pts[..., :3], pts[..., 3:]
        xyz, feats, mask = self.sa1(xyz, feats, mask)
        xyz, feats, mask = self.sa2(xyz, feats, mask)
        g = self.global_mlp(torch.cat([feats, xyz], -1).flatten(0, 1)).view(*feats.shape[:2], -1)
        g = g.masked_fill(~mask[..., None], -1e4).max(1)[0]
        return self.cls(torch.cat([g, extra], 1))


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    train_ds = ObjectCrops(args.db, args.db_root, "train")
    val_ds = ObjectCrops(args.db, args.db_root, "val")
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=6,
                          collate_fn=pad_collate, pin_memory=True, drop_last=True, persistent_workers=True)
    val_idx = list(range(rank, len(val_ds), world_size))
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, val_idx), batch_size=args.batch_size, num_workers=4,
                        collate_fn=pad_collate)

    counts = torch.tensor(train_ds.class_counts(), dtype=torch.float32)
    weights = (counts.sum() / counts.clamp(min=1)) ** 0.5
    criterion = nn.CrossEntropyLoss(weight=(weights / weights.mean()).to(device), label_smoothing=0.05)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(PointNet2Cls()).to(device)
    model = DDP(model, device_ids=[rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * world_size, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    scaler = torch.cuda.amp.GradScaler()

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        stats = torch.zeros(3, device=device)  # loss sum, correct, count
        for pts, mask, extra, labels in train_dl:
            pts, mask, extra, labels = (t.to(device, non_blocking=True) for t in (pts, mask, extra, labels))
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(pts, mask, extra)
                loss = criterion(logits.float(), labels)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            stats += torch.stack([loss.detach() * len(labels), (logits.argmax(1) == labels).sum().float(),
                                  torch.tensor(float(len(labels)), device=device)])
        sched.step()

        model.eval()
        conf = torch.zeros(len(CLASSES), len(CLASSES), device=device)
        with torch.no_grad():
            for pts, mask, extra, labels in val_dl:
                pts, mask, extra, labels = (t.to(device, non_blocking=True) for t in (pts, mask, extra, labels))
                pred = model.module(pts, mask, extra).argmax(1)
                conf.index_put_((labels, pred), torch.ones_like(labels, dtype=torch.float32), accumulate=True)
        dist.all_reduce(stats)
        dist.all_reduce(conf)
        if rank == 0:
            recall = conf.diag() / conf.sum(1).clamp(min=1)
            print(f"epoch {epoch}: train loss {stats[0] / stats[2]:.4f} acc {stats[1] / stats[2]:.4f} | "
                  f"val acc {conf.diag().sum() / conf.sum():.4f} mean recall {recall.mean():.4f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "classes": CLASSES},
                       os.path.join(args.out, "last.pt"))

    dist.destroy_process_group()


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--db", required=True)
    ap.add_argument("--db-root", required=True)
    ap.add_argument("--out", default="ckpt/objcrop_pn2")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2.5e-4, help="per GPU")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    assert args.gpus <= torch.cuda.device_count(), f"asked for {args.gpus} GPUs, {torch.cuda.device_count()} visible"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)
