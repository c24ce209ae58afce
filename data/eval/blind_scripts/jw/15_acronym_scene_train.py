"""Grasp success classifier trained on ACRONYM tabletop scenes.

Each scene file (one per simulated scene) stores a rendered point cloud and all
gripper poses tested on it in the physics simulator together with their success
flag.  A training sample is (scene cloud, one gripper pose) -> success.

Scenes are split between the GPUs by file so every process only opens and keeps
its own scene files in memory.

    torchrun --nproc_per_node=4 15_acronym_scene_train.py --scenes /data/acronym/scenes_h5 --epochs 30
"""
import argparse
import glob
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


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenes", required=True)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--points", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--val-every", type=int, default=2)
    ap.add_argument("--ckpt-dir", default="ckpt/acronym_cls")
    ap.add_argument("--workers", type=int, default=4)
    return ap.parse_args()


class ScenePoseDataset(Dataset):
    def __init__(self, files, points):
        self.points = points
        self.clouds, self.poses, self.labels, self.owner = [], [], [], []
        for si, f in enumerate(files):
            with h5py.File(f, "r") as h:
                self.clouds.append(h["cloud"][:].astype(np.float32))
                poses = h["grasps/transforms"][:].astype(np.float32)
                succ = h["grasps/qualities/object_in_gripper"][:].astype(np.float32)
            self.poses.append(poses)
            self.labels.append(succ)
            self.owner.append(np.full(len(poses), si))
        self.poses = np.concatenate(self.poses)
        self.labels = np.concatenate(self.labels)
        self.owner = np.concatenate(self.owner)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        cloud = self.clouds[self.owner[i]]
        cloud = cloud[np.random.choice(len(cloud), self.points, replace=len(cloud) < self.points)]
        T = self.poses[i]
        # express the cloud in the gripper frame so the network sees the local geometry
        local = (cloud - T[:3, 3]) @ T[:3, :3]
        return torch.from_numpy(local.astype(np.float32)), torch.tensor(self.labels[i])


class GraspEvaluator(nn.Module):
    def __init__(self):
        super().__init__()
        self.sa1 = nn.Sequential(nn.Linear(3, 64), nn.ReLU(), nn.Linear(64, 128), nn.ReLU())
        self.sa2 = nn.Sequential(nn.Linear(128 + 3, 256), nn.ReLU(), nn.Linear(256, 512))
        self.fc = nn.Sequential(nn.Linear(512, 256), nn.ReLU(), nn.Dropout(0.2), nn.Linear(256, 1))

    def forward(self, local_pts):
        # weight points near the gripper more: keep the 512 closest to the gripper origin
        d = local_pts.norm(dim=-1)
        idx = d.topk(512, largest=False).indices
        near = torch.gather(local_pts, 1, idx[..., None].expand(-1, -1, 3))
        f = self.sa1(near)
        f = self.sa2(torch.cat([f, near], -1)).max(1)[0]
        return self.fc(f).squeeze(-1)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(3, device=device)
    for pts, y in loader:
        pts, y = pts.to(device), y.to(device)
        logit = model(pts)
        s[0] += F.binary_cross_entropy_with_logits(logit, y, reduction="sum")
        s[1] += ((logit > 0).float() == y).sum()
        s[2] += len(y)
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[2]).item(), (s[1] / s[2]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_files = sorted(glob.glob(os.path.join(args.scenes, "train", "*.h5")))
    val_files = sorted(glob.glob(os.path.join(args.scenes, "val", "*.h5")))
    train_ds = ScenePoseDataset(train_files[rank::world], args.points)
    val_ds = ScenePoseDataset(val_files[rank::world], args.points)
    print(f"[rank {rank}] {len(train_files[rank::world])} scenes, {len(train_ds)} grasps", flush=True)

    train_dl = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size, num_workers=args.workers)

    model = DDP(GraspEvaluator().to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for pts, y in train_dl:
            pts, y = pts.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(pts), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(tot)
        if rank == 0:
            print(f"epoch {epoch} loss {(tot[0] / tot[1]).item():.4f} ({time.time() - t0:.0f}s)", flush=True)

        if (epoch + 1) % args.val_every == 0:
            vloss, vacc = evaluate(model.module, val_dl, device)
            if rank == 0:
                print(f"  val loss {vloss:.4f} acc {vacc:.4f}", flush=True)
                state = {"epoch": epoch, "model": model.module.state_dict(), "opt": opt.state_dict()}
                torch.save(state, os.path.join(args.ckpt_dir, "last.pt"))
                if vacc > best:
                    best = vacc
                    torch.save(state, os.path.join(args.ckpt_dir, "best.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
