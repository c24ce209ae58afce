"""Dense 7-DoF grasp prediction with graspness, grasp quality and a gripper collision head.

The collision head classifies whether the gripper at a candidate pose intersects
the scene cloud (labels come from the simulator's collision checker).  It is
switched on after a few epochs so the backbone first learns graspness.

    torchrun --nnodes=1 --nproc_per_node=8 04_anygrasp_style_train.py \
        --data /mnt/shared/grasp_scenes --epochs 40 --collision-start 5
"""
import argparse
import math
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--collision-start", type=int, default=5)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup-iters", type=int, default=1000)
    ap.add_argument("--points", type=int, default=16384)
    ap.add_argument("--seeds", type=int, default=1024, help="candidate grasp points per scene")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--save-dir", default="/mnt/shared/ckpt/anygrasp_style")
    ap.add_argument("--amp", action="store_true")
    return ap.parse_args()


class SceneH5(Dataset):
    """One HDF5 file per split; every entry is one rendered view of a scene."""

    def __init__(self, path, points, seeds):
        self.path = path
        self.points = points
        self.seeds = seeds
        with h5py.File(path, "r") as f:
            self.n = f["cloud"].shape[0]
        self.h5 = None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.h5 is None:  # open lazily, once per worker
            self.h5 = h5py.File(self.path, "r")
        cloud = self.h5["cloud"][i]
        graspness = self.h5["graspness"][i]
        sel = np.random.choice(cloud.shape[0], self.points, replace=cloud.shape[0] < self.points)
        cloud, graspness = cloud[sel], graspness[sel]
        # candidate seeds: sample proportionally to graspness label, plus random points
        p = graspness + 1e-3
        seed_idx = np.random.choice(self.points, self.seeds, replace=False, p=p / p.sum())
        quality = self.h5["quality"][i][sel][seed_idx]         # (S, views*angles)
        collision = self.h5["collision"][i][sel][seed_idx]     # (S, views*angles) bool
        return (torch.from_numpy(cloud).float(), torch.from_numpy(graspness).float(),
                torch.from_numpy(seed_idx).long(), torch.from_numpy(quality).float(),
                torch.from_numpy(collision.astype(np.float32)))


class PointBackbone(nn.Module):
    def __init__(self, dim=256):
        super().__init__()
        self.mlp1 = nn.Sequential(nn.Linear(3, 64), nn.LayerNorm(64), nn.GELU(),
                                  nn.Linear(64, 128), nn.LayerNorm(128), nn.GELU())
        self.mlp2 = nn.Sequential(nn.Linear(256, 256), nn.LayerNorm(256), nn.GELU(),
                                  nn.Linear(256, dim))

    def forward(self, xyz):
        f = self.mlp1(xyz)                           # B,N,128
        g = f.max(1, keepdim=True)[0].expand_as(f)   # B,N,128
        return self.mlp2(torch.cat([f, g], -1))      # B,N,dim


class GraspHeads(nn.Module):
    def __init__(self, dim=256, num_views=60, num_angles=12):
        super().__init__()
        k = num_views * num_angles
        self.graspness = nn.Sequential(nn.Linear(dim, 128), nn.GELU(), nn.Linear(128, 1))
        self.quality = nn.Sequential(nn.Linear(dim, 512), nn.GELU(), nn.Linear(512, k))
        self.collision = nn.Sequential(nn.Linear(dim + 3, 512), nn.GELU(), nn.Linear(512, k))


class GraspModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = PointBackbone()
        self.heads = GraspHeads()

    def forward(self, cloud, seed_idx, with_collision):
        feat = self.backbone(cloud)
        graspness = self.heads.graspness(feat).squeeze(-1)
        seed_feat = torch.gather(feat, 1, seed_idx.unsqueeze(-1).expand(-1, -1, feat.shape[-1]))
        quality = self.heads.quality(seed_feat)
        out = {"graspness": graspness, "quality": quality}
        if with_collision:
            seed_xyz = torch.gather(cloud, 1, seed_idx.unsqueeze(-1).expand(-1, -1, 3))
            out["collision"] = self.heads.collision(torch.cat([seed_feat, seed_xyz], -1))
        return out


def lr_at(it, total, warmup, base):
    if it < warmup:
        return base * (it + 1) / warmup
    return 0.5 * base * (1 + math.cos(math.pi * (it - warmup) / max(1, total - warmup)))


def reduce_mean(t):
    t = t.detach().clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train = SceneH5(os.path.join(args.data, "train.h5"), args.points, args.seeds)
    sampler = DistributedSampler(train, shuffle=True, drop_last=True)
    loader = DataLoader(train, batch_size=args.bs, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = GraspModel().to(dev)
    model = DDP(model, device_ids=[local_rank])
    base_lr = args.lr * (args.bs * world) / 64
    opt = torch.optim.AdamW(model.parameters(), lr=base_lr, weight_decay=0.05)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)
    total_iters = args.epochs * len(loader)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    it = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        use_collision = epoch >= args.collision_start
        t0 = time.time()
        for cloud, graspness, seed_idx, quality, collision in loader:
            cloud, graspness = cloud.to(dev, non_blocking=True), graspness.to(dev, non_blocking=True)
            seed_idx, quality = seed_idx.to(dev, non_blocking=True), quality.to(dev, non_blocking=True)
            collision = collision.to(dev, non_blocking=True)
            for g in opt.param_groups:
                g["lr"] = lr_at(it, total_iters, args.warmup_iters, base_lr)

            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                out = model(cloud, seed_idx, with_collision=use_collision)
                l_g = F.smooth_l1_loss(out["graspness"], graspness)
                l_q = F.smooth_l1_loss(out["quality"], quality)
                loss = l_g + l_q
                if use_collision:
                    l_c = F.binary_cross_entropy_with_logits(out["collision"], collision)
                    loss = loss + 0.5 * l_c

            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            scaler.step(opt)
            scaler.update()

            if it % 100 == 0:
                lg, lq = reduce_mean(l_g), reduce_mean(l_q)
                if rank == 0:
                    print(f"ep {epoch} it {it} lr {opt.param_groups[0]['lr']:.2e} "
                          f"graspness {lg.item():.4f} quality {lq.item():.4f}", flush=True)
            it += 1

        if rank == 0:
            print(f"epoch {epoch} took {time.time() - t0:.1f}s", flush=True)
            torch.save({"epoch": epoch, "it": it, "model": model.module.state_dict(),
                        "opt": opt.state_dict(), "scaler": scaler.state_dict()},
                       os.path.join(args.save_dir, f"epoch_{epoch:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
