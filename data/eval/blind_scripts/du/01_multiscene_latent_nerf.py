#!/usr/bin/env python
"""Multi-scene conditional NeRF with per-scene latent codes (auto-decoder).

Scenes are distributed over the GPUs so that each process only keeps the images
of its own scenes in memory. The shared MLP is trained with DDP.

    torchrun --nproc_per_node=8 01_multiscene_latent_nerf.py --data_root /data/srn_cars
"""
import argparse
import glob
import json
import math
import os
import time

import cv2
import imageio.v2 as imageio
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_root", type=str, required=True)
    p.add_argument("--out_dir", type=str, default="runs/ms_nerf")
    p.add_argument("--downscale", type=int, default=2)
    p.add_argument("--latent_dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--n_iters", type=int, default=300_000)
    p.add_argument("--batch_rays", type=int, default=16384, help="global rays per step")
    p.add_argument("--n_samples", type=int, default=96)
    p.add_argument("--near", type=float, default=0.8)
    p.add_argument("--far", type=float, default=1.8)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--lr_latent", type=float, default=1e-3)
    p.add_argument("--log_every", type=int, default=100)
    p.add_argument("--eval_every", type=int, default=10_000)
    p.add_argument("--ckpt_every", type=int, default=20_000)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def load_scene(scene_dir, downscale):
    with open(os.path.join(scene_dir, "transforms.json")) as f:
        meta = json.load(f)
    imgs, poses = [], []
    for frame in meta["frames"]:
        img = imageio.imread(os.path.join(scene_dir, frame["file_path"]))
        img = np.asarray(img, dtype=np.float32) / 255.0
        if img.shape[-1] == 4:
            img = img[..., :3] * img[..., 3:] + (1.0 - img[..., 3:])
        if downscale > 1:
            h, w = img.shape[:2]
            img = cv2.resize(img, (w // downscale, h // downscale), interpolation=cv2.INTER_AREA)
        imgs.append(img)
        poses.append(np.asarray(frame["transform_matrix"], dtype=np.float32))
    imgs = np.stack(imgs)
    H, W = imgs.shape[1:3]
    focal = 0.5 * W / math.tan(0.5 * float(meta["camera_angle_x"]))
    return torch.from_numpy(imgs), torch.from_numpy(np.stack(poses)), H, W, focal


def get_rays(H, W, focal, c2w):
    i, j = torch.meshgrid(
        torch.arange(W, dtype=torch.float32, device=c2w.device),
        torch.arange(H, dtype=torch.float32, device=c2w.device),
        indexing="xy",
    )
    dirs = torch.stack([(i - 0.5 * W) / focal, -(j - 0.5 * H) / focal, -torch.ones_like(i)], -1)
    rays_d = (dirs[..., None, :] * c2w[:3, :3]).sum(-1)
    rays_o = c2w[:3, 3].expand(rays_d.shape)
    return rays_o, rays_d


class PosEnc(nn.Module):
    def __init__(self, n_freqs):
        super().__init__()
        self.register_buffer("freqs", 2.0 ** torch.arange(n_freqs), persistent=False)

    def forward(self, x):
        xb = x[..., None] * self.freqs
        return torch.cat([x, torch.sin(xb).flatten(-2), torch.cos(xb).flatten(-2)], -1)


class LatentNeRF(nn.Module):
    def __init__(self, num_scenes, latent_dim, hidden):
        super().__init__()
        self.codes = nn.Embedding(num_scenes, latent_dim)
        nn.init.normal_(self.codes.weight, std=0.01)
        self.pe_x = PosEnc(10)
        self.pe_d = PosEnc(4)
        in_x, in_d = 3 + 3 * 2 * 10, 3 + 3 * 2 * 4
        self.trunk = nn.Sequential(
            nn.Linear(in_x + latent_dim, hidden), nn.ReLU(True),
            nn.Linear(hidden, hidden), nn.ReLU(True),
            nn.Linear(hidden, hidden), nn.ReLU(True),
            nn.Linear(hidden, hidden), nn.ReLU(True),
        )
        self.sigma = nn.Linear(hidden, 1)
        self.feat = nn.Linear(hidden, hidden)
        self.rgb = nn.Sequential(nn.Linear(hidden + in_d, hidden // 2), nn.ReLU(True), nn.Linear(hidden // 2, 3))

    def forward(self, pts, dirs, scene_idx):
        z = self.codes(scene_idx)[:, None].expand(-1, pts.shape[1], -1)
        h = self.trunk(torch.cat([self.pe_x(pts), z], -1))
        sigma = self.sigma(h).squeeze(-1)
        rgb = torch.sigmoid(self.rgb(torch.cat([self.feat(h), self.pe_d(dirs)], -1)))
        return rgb, sigma


def render_rays(model, rays_o, rays_d, scene_idx, near, far, n_samples, perturb):
    t = torch.linspace(0.0, 1.0, n_samples, device=rays_o.device)
    z = (near * (1.0 - t) + far * t).expand(rays_o.shape[0], n_samples)
    if perturb:
        mids = 0.5 * (z[:, 1:] + z[:, :-1])
        upper = torch.cat([mids, z[:, -1:]], -1)
        lower = torch.cat([z[:, :1], mids], -1)
        z = lower + (upper - lower) * torch.rand_like(z)
    pts = rays_o[:, None] + rays_d[:, None] * z[..., None]
    dirs = F.normalize(rays_d, dim=-1)[:, None].expand_as(pts)
    rgb, sigma = model(pts, dirs, scene_idx)
    delta = torch.cat([z[:, 1:] - z[:, :-1], torch.full_like(z[:, :1], 1e10)], -1)
    delta = delta * rays_d.norm(dim=-1, keepdim=True)
    alpha = 1.0 - torch.exp(-F.relu(sigma) * delta)
    trans = torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1.0 - alpha + 1e-10], -1), -1)[:, :-1]
    w = alpha * trans
    rgb_map = (w[..., None] * rgb).sum(1)
    return rgb_map + (1.0 - w.sum(-1, keepdim=True))


@torch.no_grad()
def render_image(net, H, W, focal, c2w, scene_idx, args, chunk=4096):
    rays_o, rays_d = get_rays(H, W, focal, c2w)
    rays_o, rays_d = rays_o.reshape(-1, 3), rays_d.reshape(-1, 3)
    out = []
    for s in range(0, rays_o.shape[0], chunk):
        idx = torch.full((rays_o[s:s + chunk].shape[0],), scene_idx, device=c2w.device, dtype=torch.long)
        out.append(render_rays(net, rays_o[s:s + chunk], rays_d[s:s + chunk], idx,
                               args.near, args.far, args.n_samples, perturb=False))
    return torch.cat(out).reshape(H, W, 3)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)
    np.random.seed(args.seed + rank)

    scene_dirs = sorted(d for d in glob.glob(os.path.join(args.data_root, "*")) if os.path.isdir(d))
    local_scenes = scene_dirs[rank::world_size]
    scenes = [load_scene(d, args.downscale) for d in local_scenes]
    # hold out the last view of each scene for evaluation
    train_imgs = [s[0][:-1].to(device) for s in scenes]
    train_poses = [s[1][:-1].to(device) for s in scenes]
    H, W, focal = scenes[0][2], scenes[0][3], scenes[0][4]
    if rank == 0:
        print(f"{len(scene_dirs)} scenes over {world_size} GPUs, {H}x{W}, focal {focal:.1f}")

    model = LatentNeRF(len(local_scenes), args.latent_dim, args.hidden).to(device)
    model = DDP(model, device_ids=[local_rank])
    net = model.module
    optimizer = torch.optim.Adam([
        {"params": [p for n, p in net.named_parameters() if not n.startswith("codes")], "lr": args.lr},
        {"params": net.codes.parameters(), "lr": args.lr_latent},
    ])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda it: 0.1 ** (it / args.n_iters))

    os.makedirs(args.out_dir, exist_ok=True)
    writer = SummaryWriter(args.out_dir) if rank == 0 else None
    rays_per_rank = args.batch_rays // world_size
    n_local = len(scenes)
    t0 = time.time()

    for it in range(1, args.n_iters + 1):
        # each ray picks a scene, a view and a pixel of this rank's scenes
        sid = torch.randint(0, n_local, (rays_per_rank,), device=device)
        rays_o, rays_d, target = [], [], []
        for s in range(n_local):
            m = int((sid == s).sum())
            if m == 0:
                continue
            v = torch.randint(0, train_imgs[s].shape[0], (m,), device=device)
            px = torch.randint(0, W, (m,), device=device)
            py = torch.randint(0, H, (m,), device=device)
            c2w = train_poses[s][v]
            d = torch.stack([(px - 0.5 * W) / focal, -(py - 0.5 * H) / focal, -torch.ones_like(px, dtype=torch.float32)], -1)
            rays_d.append((d[:, None, :] * c2w[:, :3, :3]).sum(-1))
            rays_o.append(c2w[:, :3, 3])
            target.append(train_imgs[s][v, py, px])
        sid = torch.sort(sid).values
        rays_o, rays_d, target = torch.cat(rays_o), torch.cat(rays_d), torch.cat(target)

        rgb = render_rays(model, rays_o, rays_d, sid, args.near, args.far, args.n_samples, perturb=True)
        mse = F.mse_loss(rgb, target)
        reg = 1e-4 * net.codes(sid).pow(2).sum(-1).mean()
        loss = mse + reg
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()

        if it % args.log_every == 0:
            stats = torch.stack([mse.detach(), reg.detach()])
            dist.all_reduce(stats, op=dist.ReduceOp.AVG)
            if rank == 0:
                psnr = -10.0 * math.log10(stats[0].item())
                writer.add_scalar("train/mse", stats[0].item(), it)
                writer.add_scalar("train/psnr", psnr, it)
                writer.add_scalar("train/latent_reg", stats[1].item(), it)
                print(f"[{it:07d}] psnr {psnr:.2f}  {time.time() - t0:.1f}s")

        if it % args.eval_every == 0:
            net.eval()
            psnr_sum = torch.zeros(2, device=device)
            for s in range(n_local):
                img = render_image(net, H, W, focal, scenes[s][1][-1].to(device), s, args)
                gt = scenes[s][0][-1].to(device)
                psnr_sum[0] += -10.0 * torch.log10(F.mse_loss(img, gt))
                psnr_sum[1] += 1
                if rank == 0 and s == 0:
                    writer.add_image("val/render", img.permute(2, 0, 1).clamp(0, 1), it)
            dist.all_reduce(psnr_sum)
            if rank == 0:
                writer.add_scalar("val/psnr", (psnr_sum[0] / psnr_sum[1]).item(), it)
            net.train()

        if it % args.ckpt_every == 0 and rank == 0:
            torch.save({"iter": it, "model": net.state_dict(), "optimizer": optimizer.state_dict(),
                        "scenes": [os.path.basename(d) for d in scene_dirs]},
                       os.path.join(args.out_dir, f"ckpt_{it:07d}.pt"))
        if it % args.ckpt_every == 0:
            dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
