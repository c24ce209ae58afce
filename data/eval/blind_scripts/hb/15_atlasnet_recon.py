"""AtlasNet (25 square patches) auto-encoding of ShapeNet point clouds, distributed training.

torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29400 \
    15_atlasnet_recon.py --data /shared/datasets/ShapeNetV1PointCloud --logdir /shared/exp/atlasnet_25sq
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

try:
    from chamfer3D.dist_chamfer_3D import chamfer_3DDist
    chamfer_dist = chamfer_3DDist()
except ImportError:  # slow fallback
    def chamfer_dist(a, b):
        d = torch.cdist(a, b).pow(2)
        return d.min(2)[0], d.min(1)[0], None, None


class ShapeNetPointClouds(Dataset):
    def __init__(self, root, split, n_points=2500, classes=None):
        with open(os.path.join(root, "taxonomy.json")) as f:
            tax = json.load(f)
        self.files = []
        for entry in tax:
            if classes and entry["name"] not in classes:
                continue
            d = os.path.join(root, entry["synsetId"], "ply_npy")
            with open(os.path.join(root, entry["synsetId"], f"{split}.txt")) as f:
                self.files += [os.path.join(d, l.strip() + ".npy") for l in f if l.strip()]
        self.n_points = n_points

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        pts = np.load(self.files[i]).astype(np.float32)[:, :3]
        pts = pts - pts.mean(0)
        pts = pts / np.linalg.norm(pts, axis=1).max()
        sel = np.random.choice(len(pts), self.n_points, replace=len(pts) < self.n_points)
        return torch.from_numpy(pts[sel])


class PointNetEnc(nn.Module):
    def __init__(self, bottleneck=1024):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv1d(3, 64, 1), nn.BatchNorm1d(64), nn.ReLU(),
            nn.Conv1d(64, 128, 1), nn.BatchNorm1d(128), nn.ReLU(),
            nn.Conv1d(128, bottleneck, 1), nn.BatchNorm1d(bottleneck))
        self.fc = nn.Sequential(nn.Linear(bottleneck, bottleneck), nn.BatchNorm1d(bottleneck), nn.ReLU())

    def forward(self, x):
        return self.fc(self.net(x.transpose(1, 2)).max(2)[0])


class PatchDeformation(nn.Module):
    def __init__(self, bottleneck=1024, hidden=512, n_layers=2):
        super().__init__()
        self.conv1 = nn.Conv1d(2, bottleneck, 1)
        self.conv2 = nn.Conv1d(bottleneck, hidden, 1)
        self.hidden = nn.ModuleList([nn.Conv1d(hidden, hidden, 1) for _ in range(n_layers)])
        self.out = nn.Conv1d(hidden, 3, 1)
        self.bn1 = nn.BatchNorm1d(bottleneck)
        self.bn2 = nn.BatchNorm1d(hidden)
        self.bns = nn.ModuleList([nn.BatchNorm1d(hidden) for _ in range(n_layers)])

    def forward(self, uv, latent):
        x = self.conv1(uv) + latent.unsqueeze(2)
        x = torch.relu(self.bn2(self.conv2(torch.relu(self.bn1(x)))))
        for conv, bn in zip(self.hidden, self.bns):
            x = torch.relu(bn(conv(x)))
        return self.out(x)


class AtlasNet(nn.Module):
    def __init__(self, n_patches=25, n_points=2500, bottleneck=1024):
        super().__init__()
        self.n_patches = n_patches
        self.pts_per_patch = n_points // n_patches
        self.encoder = PointNetEnc(bottleneck)
        self.decoders = nn.ModuleList([PatchDeformation(bottleneck) for _ in range(n_patches)])

    def forward(self, x):
        latent = self.encoder(x)
        outs = []
        for dec in self.decoders:
            uv = torch.rand(x.shape[0], 2, self.pts_per_patch, device=x.device)
            outs.append(dec(uv, latent))
        return torch.cat(outs, 2).transpose(1, 2).contiguous()


def chamfer_loss(pred, gt):
    d1, d2, _, _ = chamfer_dist(gt, pred)
    return d1.mean() + d2.mean()


def save_checkpoint(logdir, model, opt, sched, epoch, best_val, is_best):
    state = {"model": model.module.state_dict(), "optimizer": opt.state_dict(),
             "scheduler": sched.state_dict(), "epoch": epoch, "best_val": best_val}
    torch.save(state, os.path.join(logdir, "network.pth"))
    if is_best:
        torch.save(state, os.path.join(logdir, "network_best.pth"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--logdir", required=True)
    ap.add_argument("--classes", default="")
    ap.add_argument("--n_patches", type=int, default=25)
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=150)
    ap.add_argument("--lr_decay", default="120,140,145")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    os.makedirs(args.logdir, exist_ok=True)

    classes = args.classes.split(",") if args.classes else None
    train_ds = ShapeNetPointClouds(args.data, "train", classes=classes)
    test_ds = ShapeNetPointClouds(args.data, "test", classes=classes)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    test_sampler = DistributedSampler(test_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=8,
                          pin_memory=True, drop_last=True)
    test_dl = DataLoader(test_ds, args.batch_size, sampler=test_sampler, num_workers=4)

    model = AtlasNet(args.n_patches)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [int(e) for e in args.lr_decay.split(",")], 0.1)

    start_epoch, best_val = 0, float("inf")
    ckpt_path = os.path.join(args.logdir, "network.pth")
    if os.path.isfile(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        start_epoch, best_val = ck["epoch"] + 1, ck["best_val"]

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        train_stats = torch.zeros(2, device=device)
        for pts in train_dl:
            pts = pts.to(device, non_blocking=True)
            loss = chamfer_loss(model(pts), pts)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            train_stats += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()

        model.eval()
        val_stats = torch.zeros(2, device=device)
        with torch.no_grad():
            for pts in test_dl:
                pts = pts.to(device)
                val_stats += torch.stack([chamfer_loss(model(pts), pts) * pts.shape[0],
                                          torch.tensor(float(pts.shape[0]), device=device)])
        dist.all_reduce(train_stats)
        dist.all_reduce(val_stats)
        train_cd = (train_stats[0] / train_stats[1]).item()
        val_cd = (val_stats[0] / val_stats[1]).item()
        is_best = val_cd < best_val
        best_val = min(best_val, val_cd)

        save_checkpoint(args.logdir, model, opt, sched, epoch, best_val, is_best)
        if rank == 0:
            print(f"epoch {epoch} train CD {train_cd * 1e4:.3f} val CD {val_cd * 1e4:.3f} "
                  f"(best {best_val * 1e4:.3f}) {time.time() - t0:.0f}s", flush=True)
            with open(os.path.join(args.logdir, "log.txt"), "a") as f:
                f.write(json.dumps({"epoch": epoch, "train_cd": train_cd, "val_cd": val_cd}) + "\n")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
