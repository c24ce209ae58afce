"""GIGA-style joint grasp affordance + occupancy learning.

Input: TSDF of a packed/pile scene (40^3), converted from the simulated depth
renders.  Targets: grasp quality / rotation / width at the simulated grasp
centres, and occupancy at points sampled in the workspace from the object meshes.

The per-scene occupancy samples are expensive to compute from the meshes, so the
dataset precomputes them once into an .npz cache next to the raw data.

    torchrun --nproc_per_node=8 10_giga_implicit_train.py --root data/pile --epochs 20
"""
import argparse
import os
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import trimesh
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

SIZE = 0.3  # workspace edge length in metres
RES = 40


def args_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--occ-points", type=int, default=2048)
    p.add_argument("--val-scenes", type=int, default=200)
    p.add_argument("--savedir", type=Path, default=Path("runs/giga"))
    p.add_argument("--workers", type=int, default=8)
    return p


class GigaDataset(Dataset):
    def __init__(self, root: Path, scene_ids, occ_points):
        self.root = root
        self.occ_points = occ_points
        df = pd.read_csv(root / "grasps.csv")
        self.df = df[df.scene_id.isin(set(scene_ids))].reset_index(drop=True)
        self.cache_path = root / "occ_cache.npz"
        if not self.cache_path.exists():
            self._build_occ_cache()
        cache = np.load(self.cache_path)
        self.occ_pts, self.occ_lbl = cache["points"], cache["labels"]
        self.scene_row = {s: i for i, s in enumerate(cache["scene_ids"])}

    def _build_occ_cache(self):
        all_scenes = sorted(pd.read_csv(self.root / "grasps.csv").scene_id.unique())
        pts, lbl = [], []
        for sid in all_scenes:
            mesh = trimesh.load(self.root / "mesh_pose_list" / f"{sid}.obj", force="mesh")
            p = np.random.uniform(0, SIZE, size=(100000, 3)).astype(np.float32)
            pts.append(p.astype(np.float16))
            lbl.append(mesh.contains(p))
        np.savez(self.cache_path, scene_ids=np.array(all_scenes), points=np.stack(pts), labels=np.stack(lbl))

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        row = self.df.iloc[i]
        tsdf = np.load(self.root / "scenes" / f"{row.scene_id}.npz")["grid"][0].astype(np.float32)
        pos = np.array([row.x, row.y, row.z], np.float32) / SIZE - 0.5   # normalised to [-0.5, 0.5]
        rot = np.array([row.qx, row.qy, row.qz, row.qw], np.float32)
        s = self.scene_row[row.scene_id]
        sel = np.random.randint(0, self.occ_pts.shape[1], self.occ_points)
        occ_p = self.occ_pts[s, sel].astype(np.float32) / SIZE - 0.5
        occ_l = self.occ_lbl[s, sel].astype(np.float32)
        return (torch.from_numpy(tsdf)[None], torch.from_numpy(pos), torch.from_numpy(rot),
                torch.tensor(row.width / SIZE, dtype=torch.float32), torch.tensor(float(row.label)),
                torch.from_numpy(occ_p), torch.from_numpy(occ_l))


class TriplaneEncoder(nn.Module):
    def __init__(self, c=32):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv3d(1, c, 3, padding=1), nn.GroupNorm(4, c), nn.ReLU(),
            nn.Conv3d(c, c, 3, padding=1), nn.GroupNorm(4, c), nn.ReLU(),
        )
        self.unet2d = nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1))

    def forward(self, tsdf):
        f = self.conv(tsdf)                                 # B,c,D,H,W
        return [self.unet2d(f.mean(d)) for d in (2, 3, 4)]  # xy, xz, yz planes


def sample_planes(planes, p):
    """p: B,M,3 in [-0.5,0.5] -> B,M,c"""
    coords = [p[..., [1, 2]], p[..., [0, 2]], p[..., [0, 1]]]
    feats = 0
    for plane, uv in zip(planes, coords):
        feats = feats + F.grid_sample(plane, (2 * uv)[:, :, None], align_corners=True).squeeze(-1)
    return feats.transpose(1, 2)


class GIGA(nn.Module):
    def __init__(self, c=32):
        super().__init__()
        self.enc = TriplaneEncoder(c)
        self.qual = nn.Sequential(nn.Linear(c + 3, 128), nn.ReLU(), nn.Linear(128, 1))
        self.rot = nn.Sequential(nn.Linear(c + 3, 128), nn.ReLU(), nn.Linear(128, 4))
        self.width = nn.Sequential(nn.Linear(c + 3, 128), nn.ReLU(), nn.Linear(128, 1))
        self.occ = nn.Sequential(nn.Linear(c + 3, 128), nn.ReLU(), nn.Linear(128, 1))

    def forward(self, tsdf, grasp_pos, occ_pts):
        planes = self.enc(tsdf)
        fg = torch.cat([sample_planes(planes, grasp_pos[:, None]), grasp_pos[:, None]], -1).squeeze(1)
        fo = torch.cat([sample_planes(planes, occ_pts), occ_pts], -1)
        return (self.qual(fg).squeeze(-1), F.normalize(self.rot(fg), dim=-1),
                self.width(fg).squeeze(-1), self.occ(fo).squeeze(-1))


def giga_loss(out, rot, width, label, occ_l):
    q, r, w, o = out
    l_q = F.binary_cross_entropy_with_logits(q, label)
    l_r = 1 - (r * rot).sum(-1).abs()
    l_w = F.mse_loss(w, width, reduction="none")
    l_o = F.binary_cross_entropy_with_logits(o, occ_l)
    return (l_q + (label * (l_r + 0.01 * l_w))).mean() + l_o, l_q.detach(), l_o.detach()


def main():
    args = args_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    scenes = sorted(pd.read_csv(args.root / "grasps.csv", usecols=["scene_id"]).scene_id.unique())
    rng = np.random.RandomState(0)
    rng.shuffle(scenes)
    val_scenes, train_scenes = scenes[: args.val_scenes], scenes[args.val_scenes:]

    train_ds = GigaDataset(args.root, train_scenes, args.occ_points)
    val_ds = GigaDataset(args.root, val_scenes[rank::world], args.occ_points)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size, num_workers=args.workers)

    model = DDP(GIGA().to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world)

    if rank == 0:
        args.savedir.mkdir(parents=True, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        agg = torch.zeros(3, device=device)
        for tsdf, pos, rot, width, label, occ_p, occ_l in train_dl:
            tsdf, pos, rot = tsdf.to(device), pos.to(device), rot.to(device)
            width, label = width.to(device), label.to(device)
            occ_p, occ_l = occ_p.to(device), occ_l.to(device)
            loss, lq, lo = giga_loss(model(tsdf, pos, occ_p), rot, width, label, occ_l)
            opt.zero_grad()
            loss.backward()
            opt.step()
            agg += torch.stack([lq, lo, torch.ones((), device=device)])

        model.eval()
        v = torch.zeros(2, device=device)
        with torch.no_grad():
            for tsdf, pos, rot, width, label, occ_p, occ_l in val_dl:
                tsdf, pos, occ_p = tsdf.to(device), pos.to(device), occ_p.to(device)
                q, _, _, _ = model.module(tsdf, pos, occ_p)
                v[0] += ((q > 0).float().cpu() == label).sum().to(device)
                v[1] += len(label)
        dist.all_reduce(agg)
        dist.all_reduce(v)
        val_acc = (v[0] / v[1]).item()
        if rank == 0:
            print(f"epoch {epoch} qual {agg[0] / agg[2]:.4f} occ {agg[1] / agg[2]:.4f} val acc {val_acc:.4f}",
                  flush=True)
            torch.save(model.module.state_dict(), args.savedir / "giga_last.pt")
            if val_acc > best:
                best = val_acc
                torch.save(model.module.state_dict(), args.savedir / "giga_best.pt")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
