"""Top-down parallel-jaw grasping in cluttered bins from point clouds.

Data: simulated bins (20-40 random objects dropped into a tote), each with a
fused point cloud and per-point grasp labels from executing top-down grasps in
the simulator at sampled points (yaw bin, width, success).

    torchrun --nproc_per_node=8 17_cluttered_bin_picking.py --root /data/bin_sim --epochs 50
"""
import argparse
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

N_YAW = 16


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--bs", type=int, default=8)
    p.add_argument("--points", type=int, default=16384)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--val-ratio", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--out", type=Path, default=Path("outputs/bin_picking"))
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class BinScenes(Dataset):
    def __init__(self, scene_dirs, points, train):
        self.scenes = scene_dirs
        self.points = points
        self.train = train

    def __len__(self):
        return len(self.scenes)

    def __getitem__(self, i):
        d = np.load(self.scenes[i] / "labels.npz")
        xyz, rgb = d["xyz"].astype(np.float32), d["rgb"].astype(np.float32) / 255.0
        succ, yaw, width, labelled = d["success"], d["yaw_bin"], d["width"], d["labelled"]
        sel = np.random.choice(len(xyz), self.points, replace=len(xyz) < self.points)
        xyz, rgb, succ, yaw, width, labelled = xyz[sel], rgb[sel], succ[sel], yaw[sel], width[sel], labelled[sel]
        if self.train:
            k = np.random.randint(4)  # the tote is symmetric under 90 degree turns
            c, s = np.cos(k * np.pi / 2), np.sin(k * np.pi / 2)
            xyz[:, :2] = xyz[:, :2] @ np.array([[c, -s], [s, c]], dtype=np.float32).T
            yaw = (yaw + k * N_YAW // 4) % N_YAW
            rgb = np.clip(rgb * np.random.uniform(0.8, 1.2), 0, 1)
        feats = np.concatenate([xyz, rgb], 1)
        return (torch.from_numpy(feats), torch.from_numpy(succ.astype(np.float32)),
                torch.from_numpy(yaw.astype(np.int64)), torch.from_numpy(width.astype(np.float32)),
                torch.from_numpy(labelled.astype(np.float32)))


class BinGraspNet(nn.Module):
    def __init__(self, c=128):
        super().__init__()
        self.l1 = nn.Sequential(nn.Conv1d(6, 64, 1), nn.GroupNorm(8, 64), nn.ReLU(),
                                nn.Conv1d(64, c, 1), nn.GroupNorm(8, c), nn.ReLU())
        self.l2 = nn.Sequential(nn.Conv1d(c, 2 * c, 1), nn.GroupNorm(8, 2 * c), nn.ReLU(),
                                nn.Conv1d(2 * c, 4 * c, 1))
        self.dec = nn.Sequential(nn.Conv1d(5 * c, 2 * c, 1), nn.GroupNorm(8, 2 * c), nn.ReLU(),
                                 nn.Conv1d(2 * c, c, 1), nn.ReLU())
        self.success = nn.Conv1d(c, 1, 1)
        self.yaw = nn.Conv1d(c, N_YAW, 1)
        self.width = nn.Conv1d(c, 1, 1)

    def forward(self, feats):
        x = feats.transpose(1, 2)
        f1 = self.l1(x)
        g = self.l2(f1).max(-1, keepdim=True)[0].expand(-1, -1, f1.shape[-1])
        h = self.dec(torch.cat([f1, g], 1))
        return self.success(h).squeeze(1), self.yaw(h), self.width(h).squeeze(1)


def loss_fn(out, succ, yaw, width, labelled):
    s_logit, yaw_logit, w = out
    n = labelled.sum().clamp(min=1)
    l_s = (F.binary_cross_entropy_with_logits(s_logit, succ, reduction="none") * labelled).sum() / n
    pos = labelled * succ
    npos = pos.sum().clamp(min=1)
    l_y = (F.cross_entropy(yaw_logit, yaw, reduction="none") * pos).sum() / npos
    l_w = (F.smooth_l1_loss(w, width, reduction="none") * pos).sum() / npos
    return l_s + l_y + 5 * l_w


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    m = torch.zeros(4, device=device)  # top1-correct, scenes, labelled-correct, labelled
    for feats, succ, yaw, width, labelled in loader:
        feats, succ, labelled = feats.to(device), succ.to(device), labelled.to(device)
        s_logit, _, _ = model(feats)
        # precision of the single best grasp per bin (what the robot would execute)
        masked = s_logit.masked_fill(labelled == 0, -1e9)
        top = masked.argmax(1)
        m[0] += succ.gather(1, top[:, None]).sum()
        m[1] += feats.shape[0]
        m[2] += (((s_logit > 0).float() == succ).float() * labelled).sum()
        m[3] += labelled.sum()
    dist.all_reduce(m)
    model.train()
    return (m[0] / m[1]).item(), (m[2] / m[3]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    seed_everything(args.seed + rank)

    scene_dirs = sorted(p for p in args.root.iterdir() if (p / "labels.npz").exists())
    random.shuffle(scene_dirs)
    n_val = int(len(scene_dirs) * args.val_ratio)
    val_dirs, train_dirs = scene_dirs[:n_val], scene_dirs[n_val:]
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "val_scenes.txt", "w") as f:
            f.write("\n".join(str(p) for p in val_dirs))

    train_ds = BinScenes(train_dirs, args.points, train=True)
    val_ds = BinScenes(val_dirs[rank::world], args.points, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.bs, num_workers=args.workers)

    model = DDP(BinGraspNet().to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * world, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_dl))

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        tr = torch.zeros(2, device=device)
        for feats, succ, yaw, width, labelled in train_dl:
            feats, succ, yaw = feats.to(device, non_blocking=True), succ.to(device), yaw.to(device)
            width, labelled = width.to(device), labelled.to(device)
            loss = loss_fn(model(feats), succ, yaw, width, labelled)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            tr += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tr)
        top1, acc = validate(model.module, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch}: loss {(tr[0] / tr[1]).item():.4f} top1-success {top1:.3f} "
                  f"point acc {acc:.3f} ({time.time() - t0:.0f}s)", flush=True)
            state = {"epoch": epoch, "model": model.module.state_dict(), "opt": opt.state_dict()}
            torch.save(state, args.out / "last.pt")
            if top1 > best:
                best = top1
                torch.save(state, args.out / "best.pt")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
