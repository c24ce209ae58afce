"""Multi-scene latent-conditioned NeRF on ScanNet (depth-supervised).

Scenes are assigned to GPUs round-robin; each process streams the rays of its
own scenes (colour + sensor depth) through a DataLoader. The conditional MLP
and the per-scene codes (global table, one row per scene) are trained with DDP.

    torchrun --nproc_per_node=8 18_scannet_latent_nerf.py --scannet /data/scannet/scans --scene_list splits/train_40.txt
"""
import argparse
import glob
import math
import os

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.tensorboard import SummaryWriter


class ScanNetRays(Dataset):
    """All pixels of every `stride`-th frame of one ScanNet scene (exported with the SensReader)."""

    def __init__(self, scene_dir, scene_idx, stride=10, size=(320, 240)):
        K = np.loadtxt(os.path.join(scene_dir, "intrinsic", "intrinsic_color.txt"))[:3, :3]
        frames = sorted(glob.glob(os.path.join(scene_dir, "color", "*.jpg")), key=lambda p: int(os.path.basename(p)[:-4]))
        frames = frames[::stride]
        W, H = size
        o_all, d_all, rgb_all, dep_all = [], [], [], []
        for f in frames:
            fid = os.path.basename(f)[:-4]
            c2w = np.loadtxt(os.path.join(scene_dir, "pose", fid + ".txt")).astype(np.float32)
            if not np.isfinite(c2w).all():
                continue
            img = cv2.imread(f)[..., ::-1]
            sx, sy = W / img.shape[1], H / img.shape[0]
            img = cv2.resize(img, (W, H), interpolation=cv2.INTER_AREA).astype(np.float32) / 255.0
            dep = cv2.imread(os.path.join(scene_dir, "depth", fid + ".png"), cv2.IMREAD_UNCHANGED).astype(np.float32) / 1000.0
            dep = cv2.resize(dep, (W, H), interpolation=cv2.INTER_NEAREST)
            u, v = np.meshgrid(np.arange(W) + 0.5, np.arange(H) + 0.5)
            d = np.stack([(u - K[0, 2] * sx) / (K[0, 0] * sx), (v - K[1, 2] * sy) / (K[1, 1] * sy), np.ones_like(u)], -1)
            d = d.reshape(-1, 3) @ c2w[:3, :3].T  # OpenCV camera, z forward
            o_all.append(np.broadcast_to(c2w[:3, 3], d.shape))
            d_all.append(d)
            rgb_all.append(img.reshape(-1, 3))
            dep_all.append(dep.reshape(-1))
        self.rays = torch.from_numpy(np.concatenate([np.concatenate(o_all), np.concatenate(d_all)], -1).astype(np.float32))
        self.rgb = torch.from_numpy(np.concatenate(rgb_all))
        self.depth = torch.from_numpy(np.concatenate(dep_all))
        self.scene_idx = scene_idx

    def __len__(self):
        return self.rays.shape[0]

    def __getitem__(self, i):
        return self.rays[i], self.rgb[i], self.depth[i], self.scene_idx


class CondNeRF(nn.Module):
    def __init__(self, n_scenes, code_dim=64, width=256, n_freq=8):
        super().__init__()
        self.codes = nn.Embedding(n_scenes, code_dim)
        nn.init.normal_(self.codes.weight, std=1e-2)
        self.n_freq = n_freq
        d_in = 3 + 6 * n_freq + code_dim
        self.net = nn.Sequential(nn.Linear(d_in, width), nn.ReLU(True), nn.Linear(width, width), nn.ReLU(True),
                                 nn.Linear(width, width), nn.ReLU(True), nn.Linear(width, width), nn.ReLU(True))
        self.sigma = nn.Linear(width, 1)
        self.rgb = nn.Sequential(nn.Linear(width + 3, width // 2), nn.ReLU(True), nn.Linear(width // 2, 3), nn.Sigmoid())

    def forward(self, o, d, scene, near=0.1, far=8.0, n=128):
        t = torch.linspace(near, far, n, device=o.device).expand(o.shape[0], -1)
        t = t + torch.rand_like(t) * (far - near) / n if self.training else t
        pts = o[:, None] + d[:, None] * t[..., None]
        f = 2.0 ** torch.arange(self.n_freq, device=o.device)
        xf = (pts[..., None] * f).flatten(-2)
        z = self.codes(scene)[:, None].expand(-1, n, -1)
        h = self.net(torch.cat([pts, xf.sin(), xf.cos(), z], -1))
        sigma = F.relu(self.sigma(h).squeeze(-1))
        rgb = self.rgb(torch.cat([h, F.normalize(d, dim=-1)[:, None].expand(-1, n, -1)], -1))
        delta = torch.cat([t[:, 1:] - t[:, :-1], torch.full_like(t[:, :1], 1e10)], -1) * d.norm(dim=-1, keepdim=True)
        alpha = 1 - torch.exp(-sigma * delta)
        w = alpha * torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1 - alpha + 1e-10], -1), -1)[:, :-1]
        return (w[..., None] * rgb).sum(1), (w * t).sum(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scannet", required=True)
    ap.add_argument("--scene_list", required=True)
    ap.add_argument("--out", default="runs/scannet_latent")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8192, help="global rays per step")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--w_depth", type=float, default=0.1)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(rank)

    with open(args.scene_list) as f:
        scenes = [l.strip() for l in f if l.strip()]
    my_scenes = list(range(rank, len(scenes), world))
    local_ds = ConcatDataset([ScanNetRays(os.path.join(args.scannet, scenes[i]), i) for i in my_scenes])
    loader = DataLoader(local_ds, batch_size=args.batch // world, shuffle=True, num_workers=6,
                        pin_memory=True, drop_last=True)
    print(f"rank {rank}: scenes {[scenes[i] for i in my_scenes]}, {len(local_ds)} rays, {len(loader)} steps/epoch", flush=True)

    model = DDP(CondNeRF(len(scenes)).to(dev), device_ids=[local_rank])
    optim = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ExponentialLR(optim, gamma=0.1 ** (1 / args.epochs))
    writer = SummaryWriter(args.out) if rank == 0 else None

    step = 0
    for epoch in range(args.epochs):
        model.train()
        run = torch.zeros(3, device=dev)
        for rays, rgb, depth, sid in loader:
            rays, rgb, depth, sid = rays.to(dev), rgb.to(dev), depth.to(dev), sid.to(dev)
            pred, pred_d = model(rays[:, :3], rays[:, 3:], sid)
            valid = depth > 0
            l_rgb = F.mse_loss(pred, rgb)
            l_d = F.l1_loss(pred_d[valid], depth[valid]) if valid.any() else pred_d.sum() * 0
            loss = l_rgb + args.w_depth * l_d
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            run += torch.stack([l_rgb.detach(), l_d.detach(), torch.ones((), device=dev)])
            step += 1
        sched.step()

        dist.all_reduce(run)
        if rank == 0:
            writer.add_scalar("epoch/mse", (run[0] / run[2]).item(), epoch)
            writer.add_scalar("epoch/psnr", -10 * math.log10((run[0] / run[2]).item()), epoch)
            writer.add_scalar("epoch/depth_l1", (run[1] / run[2]).item(), epoch)
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "scenes": scenes},
                       os.path.join(args.out, "latest.pt"))
        dist.barrier()

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
